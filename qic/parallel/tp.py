"""Tensor-parallel execution: the all_reduce and all_gather hooks, per-rank state dicts, process groups.

Plans (each component's own table, in its definition: Qwen-Image's in qic/models/qwen_image/components.py;
applied by qic.parallel.plans):
- text encoder: q/k/v column-parallel by heads (GQA: query and key/value heads both divide by TP, so
  TP may not exceed the key/value heads; the module refuses larger TP with a ConfigError naming the
  counts), o_proj row-parallel + all_reduce; gate/up column-parallel, down_proj row-parallel + all_reduce;
  the token embedding vocab-parallel (masked lookup of the rank's rows + all_reduce; a vocabulary that
  does not divide by TP is zero-padded to ceil(V / TP) rows a rank, rows no token id reaches).
- denoiser: both streams' Q/K/V column-parallel by heads (joint attention runs per head, so each rank
  attends over the full [text | image] sequence with its own heads), both output projections
  row-parallel + all_reduce, both MLPs column then row-parallel with the all_reduce before the gated
  residual add; the per-block modulation, the output norm's projection and the text input projection
  column-parallel + all_gather of their output; the timestep embedder column then row-parallel; norms,
  RoPE, img_in and proj_out (thin: latent channels) replicated.
- VAE decoder: replicated.

`RowLinear` adds its bias after the reduction, so a row-parallel bias counts once. `GatherLinear`'s
gather is `all_gather_into_tensor` (AOTInductor has no C shim for it on CPU and calls it through its
proxy executor; it runs the same under gloo).

The reduction is `torch.ops._c10d_functional.all_reduce(x, "sum", group_name)` followed by
`wait_tensor`: the same ops in eager mode and in a traced graph. torch.export records the group by
its *name* (a string constant in the graph, "0" for the default world group); AOTInductor compiles
the call into the package, and at run time the name is resolved in the calling process's registry of
process groups. Only weights differ between ranks, so one compiled artifact serves every rank, as long
as each rank has created its groups in the same order (the world group is always "0").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from qic.errors import ConfigError
from qic.models.common import GatherLinear, RowLinear, VocabEmbedding
from qic.parallel import plans
from qic.parallel.ranks import (  # noqa: F401  (re-exported: one import for TP users)
    DEFAULT_TIMEOUT,
    RankFailure,
    RankOutcome,
    free_port,
    group_name,
    init_from_env,
    spawn,
)

# ------------------------------------------------------------------------------------------- the hook

class AllReduce:
    """RowLinear's `reduce` hook: sum over a process group, as a functional collective plus its wait.

    Holds the group's name, not the group: a plain string that torch.export records in the graph.
    Not an nn.Module, so setting it on a RowLinear adds no submodule and no state_dict entry.
    """

    def __init__(self, group_name: str):
        self.group_name = str(group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops._c10d_functional.all_reduce(x, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(y)

    def __repr__(self) -> str:
        return f"AllReduce(sum, group={self.group_name!r})"


class AllGather:
    """GatherLinear's `gather` hook: every rank's [..., n] chunk, concatenated in rank order along the last
    dim. all_gather_into_tensor stacks along dim 0, so the [size, ...] result is moved to the feature dim."""

    def __init__(self, group_name: str, size: int):
        self.group_name, self.size = str(group_name), int(size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), self.size, self.group_name)
        y = torch.ops._c10d_functional.wait_tensor(y)
        return y.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def __repr__(self) -> str:
        return f"AllGather(size={self.size}, group={self.group_name!r})"


_REDUCED = (RowLinear, VocabEmbedding)  # modules whose `reduce` hook sums over the group


def _tp_sizes(module: torch.nn.Module) -> set[int]:
    return {m.tp_size for m in module.modules() if isinstance(getattr(m, "tp_size", None), int)}


def tp_size_of(module: torch.nn.Module) -> int:
    """The TP degree a module was built for (1 when it has no tensor-parallel layers)."""
    return max(_tp_sizes(module), default=1)


def apply_tp(module: torch.nn.Module, group=None) -> int:
    """Make `module` (built with tp_size = the group's size) one rank's part of the computation.

    Sets `reduce` on every RowLinear and VocabEmbedding to an all_reduce("sum") over `group` (a
    ProcessGroup, a group name, or None for the world group) and `gather` on every GatherLinear to an
    all_gather. Returns how many modules were set. A group of size 1 clears the hooks instead (plain
    arithmetic). Refuses a module whose tp_size differs from the group's size: its shards would not add
    up to the whole.
    """
    if isinstance(group, str):
        name, size = group, None
        if dist.is_initialized():
            size = dist.distributed_c10d._get_group_size_by_name(group)
    else:
        name = group_name(group)
        size = dist.get_world_size(group)
    sizes = _tp_sizes(module)
    if size is not None and sizes and sizes != {size}:
        raise ConfigError(f"module was built for tp_size {sorted(sizes)}, but the process group has {size} ranks")
    if size is None:  # a group named while no process group exists (tracing only): the module's own size
        size = next(iter(sizes), 1)
    reduce = None if size == 1 else AllReduce(name)
    gather = None if size == 1 else AllGather(name, size)
    n = 0
    for m in module.modules():
        if isinstance(m, _REDUCED):
            m.reduce = reduce
            n += 1
        elif isinstance(m, GatherLinear):
            m.gather = gather
            n += 1
    return n


def clear_tp(module: torch.nn.Module) -> None:
    """Remove the reduce hooks (back to the class default: no reduction)."""
    for m in module.modules():
        for hook in ("reduce", "gather"):
            if hook in vars(m):
                delattr(m, hook)


# ------------------------------------------------------------------------------------------- weights

def shard_state_dict(component: str, full_state_dict: Mapping[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """One rank's tensors of a component's full (TP=1, module-named) state dict, by qic.parallel.plans.

    The same slicing stage 1 writes to disk (`plans.rank_slice`): column-parallel tensors are a
    contiguous chunk of rows, row-parallel ones a chunk of columns, everything else whole; plus the
    plan's per-rank tensors (`plans.rank_tensors`). A split that does not divide by tp is refused, except
    for the plan's padded tensors (the vocabulary), whose ranks get ceil(n / tp) rows, zero-padded.
    """
    plan = plans.plan_of(component)   # an unknown component: one ConfigError line naming the known
    if not (isinstance(tp, int) and tp >= 1 and 0 <= rank < tp):
        raise ConfigError(f"rank {rank} of tp {tp} is not a valid rank")
    out = {}
    for name, t in full_state_dict.items():
        dim = plans.split_dim(component, name)
        if dim is not None and t.shape[dim] % tp and name not in plan.padded:
            raise ConfigError(f"{component}: tensor {name} has {t.shape[dim]} along dim {dim}, "
                              f"not divisible by tp {tp}")
        out[name] = plans.rank_slice(component, name, t, rank, tp).contiguous()
    shapes = {name: tuple(t.shape) for name, t in full_state_dict.items()}
    if tp > 1 and all(of in shapes for of, _ in plan.rank_tensors.values()):
        out.update(plans.rank_tensors(component, shapes, rank, tp))
    return out


