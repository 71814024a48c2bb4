"""The builder's helpers over a component's definition (qic.family.Component; Qwen-Image's are in
qic.models.qwen_image.components): the code that keys its shards, and the tensors one rank's module holds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from qic.family import Component


def source_digest(component: Component) -> bytes:
    """The code that decides a component's converted weights (its `sources` modules' bytes), for shard keys."""
    return b"".join(Path(importlib.util.find_spec(m).origin).read_bytes() for m in component.sources)


def expected_tensors(component: Component, config, tp_size: int, looped: bool = False) -> dict[str, tuple[int, ...]]:
    """Names and shapes one rank's module holds, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = component.make_module(config, tp_size=tp_size, looped=looped)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}
