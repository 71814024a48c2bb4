"""The three compiled components: where their weights live in a checkpoint, how to build their eager
modules, and how checkpoint tensors become module tensors. One table, used by every build stage."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qic.models.looped import LoopedMMDiT, LoopedTextEncoder
from qic.models.mmdit import MMDiTConfig, QwenMMDiT, mmdit_state_dict
from qic.models.text_encoder import QwenTextEncoder, TextEncoderConfig, text_encoder_state_dict
from qic.models.vae_decoder import QwenVAEDecoder, VAEConfig, vae_decoder_state_dict

_MODELS = Path(__file__).resolve().parent.parent / "models"


@dataclass(frozen=True)
class Component:
    name: str                     # qic's name: text_encoder | denoiser | vae_decoder
    folder: str                   # the checkpoint folder holding its config and weights
    parse_config: Callable[[Mapping], object]
    make_module: Callable[..., torch.nn.Module]   # (config, tp_size, looped) -> module with the checkpoint's names
    convert: Callable[[Mapping], dict]            # per-tensor: {ckpt name: t} -> {module name: t'}
    sources: tuple[str, ...]      # model files whose code decides the converted weights (cache keys)
    fixed_dtype: str | None = None  # a component that always runs in this dtype
    stackable: bool = False         # has a looped form over stacked block weights (qic.models.looped)


def _vae_module(config: VAEConfig, tp_size: int = 1, looped: bool = False) -> torch.nn.Module:
    # Weights do not depend on the resolution; any valid one gives the module's tensor names and shapes.
    step = 2 * config.scale_factor
    return QwenVAEDecoder(config, step, step)


COMPONENTS: dict[str, Component] = {
    "text_encoder": Component("text_encoder", "text_encoder", TextEncoderConfig.from_dict,
                              lambda cfg, tp_size=1, looped=False:
                                  (LoopedTextEncoder if looped else QwenTextEncoder)(cfg, tp_size=tp_size),
                              text_encoder_state_dict, ("text_encoder.py", "common.py", "looped.py"),
                              stackable=True),
    "denoiser": Component("denoiser", "transformer", MMDiTConfig.from_dict,
                          lambda cfg, tp_size=1, looped=False:
                              (LoopedMMDiT if looped else QwenMMDiT)(cfg, tp_size=tp_size),
                          mmdit_state_dict, ("mmdit.py", "common.py", "looped.py"), stackable=True),
    # The VAE decoder runs in fp32 whatever the build's dtype (bf16 decoding visibly bands images).
    "vae_decoder": Component("vae_decoder", "vae", VAEConfig.from_dict, _vae_module,
                             vae_decoder_state_dict, ("vae_decoder.py", "common.py"), fixed_dtype="float32"),
}


def source_digest(component: Component) -> bytes:
    """The code that decides a component's converted weights, for shard cache keys."""
    return b"".join((_MODELS / f).read_bytes() for f in component.sources)


def expected_tensors(component: Component, config, tp_size: int, looped: bool = False) -> dict[str, tuple[int, ...]]:
    """Names and shapes one rank's module holds, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = component.make_module(config, tp_size=tp_size, looped=looped)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}
