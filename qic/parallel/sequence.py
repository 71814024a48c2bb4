"""Ulysses sequence parallelism and CFG-parallel: their collectives, and setting every hook of a layout.

The collectives are functional (`_c10d_functional.all_to_all_single`, `all_gather_into_tensor`) on the mesh
axes' alias names (qic.parallel.mesh), the same ops eagerly and in a traced graph, so a compiled graph
carries them and the neuron back end lowers them to HLO all-to-all / all-gather with the axis' replica
groups.
"""

from __future__ import annotations

import torch

from qic.errors import ConfigError
from qic.parallel.mesh import Layout
from qic.parallel.tp import apply_tp


def _all_to_all(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """[size, ...] -> [size, ...]: slot j goes to rank j; slot j of the result came from rank j."""
    y = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), [x.shape[0] // size] * size,
                                                     [x.shape[0] // size] * size, group)
    return torch.ops._c10d_functional.wait_tensor(y)


def _all_gather(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """[n, ...] -> [size * n, ...], the ranks' tensors in rank order along dim 0."""
    y = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group)
    return torch.ops._c10d_functional.wait_tensor(y)


class HeadExchange:
    """JointAttention's `exchange`: tokens-sharded q/k/v [B, S/U, H, D] <-> heads-sharded [B, S, H/U, D].
    q, k and v travel in one all-to-all; the keys come back in rank-interleaved order (rank j's tokens
    in slot j)."""

    def __init__(self, group_name: str, size: int):
        self.group_name, self.size = group_name, size

    def to_heads(self, q, k, v):
        x = torch.stack([q, k, v]).unflatten(3, (self.size, -1)).movedim(3, 0)   # [U, 3, B, S/U, H/U, D]
        x = _all_to_all(x, self.size, self.group_name)                            # slot j: rank j's tokens
        x = x.movedim(0, 2).flatten(2, 3)                                         # [3, B, S, H/U, D]
        return x.unbind(0)

    def to_tokens(self, out):
        x = out.unflatten(1, (self.size, -1)).movedim(1, 0)                       # [U, B, S/U, H/U, D]
        x = _all_to_all(x, self.size, self.group_name)                            # slot j: head group j
        return x.movedim(0, 2).flatten(2, 3)                                      # [B, S/U, H, D]

    def __repr__(self) -> str:
        return f"HeadExchange(size={self.size}, group={self.group_name!r})"


class StackGather:
    """[n, ...] -> [size, n, ...]: every rank's tensor (UlyssesShard's image-token gather)."""

    def __init__(self, group_name: str, size: int):
        self.group_name, self.size = group_name, size

    def __call__(self, x):
        return _all_gather(x, self.size, self.group_name).unflatten(0, (self.size, -1))


class SumReduce:
    """UlyssesShard's `reduce`: a sum over the group (the step-cache figure's sums over every rank's tokens)."""

    def __init__(self, group_name: str):
        self.group_name = group_name

    def __call__(self, x):
        y = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(y)


class RowGather(StackGather):
    """[n, ...] -> [size * n, ...] (CFG-parallel: the cond rows, then the uncond rows)."""

    def __call__(self, x):
        return _all_gather(x, self.size, self.group_name)


def check_layout(layout: Layout, heads: int) -> None:
    """Ulysses splits the heads each TP rank keeps: U must divide them."""
    left = heads // layout.tp
    if layout.ulysses > 1 and left % layout.ulysses:
        raise ConfigError(f"ulysses {layout.ulysses} does not divide the {left} attention heads each of tp "
                          f"{layout.tp} ranks keeps ({heads} heads)",
                          f"use ulysses dividing {left}, or a smaller tp")


def ulysses_collectives(layout: Layout) -> tuple[StackGather, SumReduce] | None:
    """A step graph's Ulysses token gather and figure sum over the sequence group (None: no Ulysses); the family's
    token sharding takes them (Qwen-Image: qic.models.qwen_image.ulysses.ulysses_shard)."""
    if layout.ulysses == 1:
        return None
    sp = layout.group_name("sp")
    return StackGather(sp, layout.ulysses), SumReduce(sp)


def cfg_gather(layout: Layout) -> RowGather | None:
    """A step graph's CFG-parallel prediction gather over the CFG pair (None: no CFG-parallel)."""
    return RowGather(layout.group_name("cfg"), layout.cfg) if layout.cfg > 1 else None


def apply_layout(module: torch.nn.Module, layout: Layout) -> None:
    """Set the collective hooks inside `module`'s denoiser for `layout`: TP's reduces and gathers and Ulysses'
    q/k/v exchanges (none at size 1). These are set on the one denoiser module every graph of a build shares
    (and that the memory plan swaps for stand-ins); the step graphs' own collectives (Ulysses' token gather and
    figure sum, CFG-parallel's prediction gather) are their constructors' arguments (the family's token sharding
    over ulysses_collectives, and cfg_gather). An attention takes the exchange if it has the `exchange` hook."""
    if layout.tp > 1:
        apply_tp(module, layout.group_name("tp"))
    if layout.ulysses > 1:
        exchange = HeadExchange(layout.group_name("sp"), layout.ulysses)
        for m in module.modules():
            if hasattr(m, "exchange"):   # an attention with Ulysses' q/k/v hook (Qwen-Image's JointAttention)
                m.exchange = exchange
