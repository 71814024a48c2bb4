"""What the runtime's host program needs of a loaded model: the one interface of a compiled bundle
(qic.runtime.bundle.Bundle) and of its eager stand-in (qic.builder.eager.EagerModel), so that generate(),
step caching's loop and the checks that put one in place of the other rely on these members and no others.

Run-time safe: the manifest's layout and the tokenizer's type only (no model, builder or compiler code).
The host fields (resolutions, buckets, prompt, latents, scheduler, tokenizer) are what the text-to-image
program reads; a bundle of a family whose program needs fewer has them empty or None (qic.runtime.programs).
The classes do not inherit from these protocols (a missing member would then be inherited as a stub);
tests/test_runtime_protocol.py checks member by member that both implement them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from tokenizers import Tokenizer

from qic.errors import ConfigError
from qic.parallel.mesh import Layout


@runtime_checkable
class GraphFn(Protocol):
    """One graph: called with its non-fixed inputs in order (the rank inputs are filled in), returns its outputs."""

    inputs: list[dict]   # name, shape, dtype of every input, as exported

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]: ...


@runtime_checkable
class Runnable(Protocol):
    """A loaded model the runtime runs: its graphs by name, its parallel place, and its host-side settings."""

    layout: Layout                       # the parallel layout its graphs were made for
    coords: dict[str, int]               # this rank's coordinates on the layout's axes (tp, sp, cfg)
    rank: int
    world: int
    resolutions: list[tuple[int, int]]   # (height, width) it holds graphs for; the first is the default
    buckets: list[int]                   # text buckets (0: exact length)
    defaults: dict                       # run defaults (steps, guidance, cache_*)
    prompt: dict                         # template, drop_tokens, max_tokens
    latents: dict                        # z_dim, vae_scale_factor, channels
    scheduler: dict                      # the flow-matching scheduler's config
    tokenizer: Tokenizer
    # The host fields its family's manifest_fields hook records (a bundle's whole manifest): where a family's own
    # program reads what is its alone (Qwen-Image-2.1's sample_sigmas, its denoiser's RoPE axes)
    manifest: dict
    step_cache: dict | None              # {first, last}: the split step graphs are in (None: not)
    lockstep: bool                       # its ranks must call the same graphs in the same order (qic.backends)

    def graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
              part: str | None = None, rows: int | None = None) -> GraphFn: ...

    def has_graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
                  part: str | None = None, rows: int | None = None) -> bool: ...

    def check_resolution(self, height: int, width: int) -> None: ...


def refuse_unlisted(height: int, width: int, resolutions, what: str) -> None:
    """check_resolution's rule: a resolution the model holds no graphs for is refused in one line."""
    if (height, width) not in resolutions:
        have = ", ".join(f"{h}x{w}" for h, w in resolutions)
        raise ConfigError(f"resolution {height}x{width} is not in this {what} (it has: {have})",
                          "pick one of those, or rebuild with --resolution")
