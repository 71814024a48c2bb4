"""Eager PyTorch at several ranks in one process: the reference a multi-rank lowered graph is checked against.

Each rank runs the same eager module in its own thread, with its own weights and inputs; the functional
collectives the models issue (`_c10d_functional.all_reduce`, `all_gather_into_tensor`, `all_to_all_single`,
`wait_tensor`: qic/parallel/tp.py, qic/parallel/sequence.py) are answered by a dispatch mode that meets
the other ranks of the collective's replica group in memory, so the ranks' results are what a real world
of processes would compute. The build traces under torch's fake process group, whose collectives return
their input unchanged: without this mode a TP graph's eager result would be one rank's partial sum.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qic.models.looped import layer_loop

_C10D = torch.ops._c10d_functional
TIMEOUT_S = 300.0   # a rank that never arrives (a bug in the module's collectives) fails the check, not hangs it


class _Meeting:
    """Where the ranks of one collective call hand each other their tensors."""

    def __init__(self):
        self.cond = threading.Condition()
        self.slots: dict[tuple, dict[int, torch.Tensor]] = {}
        self.failed: BaseException | None = None

    def exchange(self, key: tuple, members: list[int], rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor for this call, in the group's order."""
        with self.cond:
            self.slots.setdefault(key, {})[rank] = x
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self.failed or len(self.slots[key]) == len(members), TIMEOUT_S)
            if self.failed or not ok:
                raise RuntimeError(f"rank {rank}: collective {key[0]} on group {members}: the other ranks "
                                   f"did not arrive ({self.failed or f'{TIMEOUT_S:.0f} s'})")
            return [self.slots[key][m] for m in members]

    def fail(self, e: BaseException) -> None:
        with self.cond:
            self.failed = e
            self.cond.notify_all()


class _Collectives(TorchDispatchMode):
    def __init__(self, meeting: _Meeting, rank: int, groups: dict[str, list[list[int]]]):
        super().__init__()
        self.meeting, self.rank, self.groups = meeting, rank, groups
        self.calls: dict[str, int] = {}

    def _members(self, name: str) -> list[int]:
        if name not in self.groups:
            raise RuntimeError(f"collective on group {name!r}, which the layout does not name "
                               f"({', '.join(sorted(self.groups))})")
        return next(g for g in self.groups[name] if self.rank in g)

    def _meet(self, op: str, name: str, x: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        members = self._members(name)
        n = self.calls[name] = self.calls.get(name, 0) + 1   # SPMD: every member makes its calls in one order
        return members, self.meeting.exchange((op, name, tuple(members), n), members, self.rank, x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _C10D.all_reduce.default:
            x, op, name = args
            if op != "sum":
                raise RuntimeError(f"all_reduce {op!r}: only sum is modelled")
            _, parts = self._meet("all_reduce", name, x)
            return torch.stack(parts).sum(0)
        if func is _C10D.all_gather_into_tensor.default:
            x, _, name = args
            return torch.cat(self._meet("all_gather", name, x)[1])
        if func is _C10D.all_to_all_single.default:
            x, out_splits, in_splits, name = args
            members, parts = self._meet("all_to_all", name, x)
            me = members.index(self.rank)
            return torch.cat([p.split(list(in_splits))[me] for p in parts])
        if func is _C10D.wait_tensor.default:
            return args[0]
        return func(*args, **kwargs)


def host_loop(layer, carry: list[torch.Tensor], xs: list[torch.Tensor], invariants
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """qic.models.looped's loop contract as a Python loop: torch's scan operator runs its body outside a
    dispatch mode, where the collectives would reach the build's fake process group. Per-layer outputs
    stacked in layer order."""
    per_layer = []
    for i in range(xs[0].shape[0]):
        carry, ys = layer(carry, [x[i] for x in xs], invariants)
        per_layer.append(ys)
    return list(carry), [torch.stack(y) for y in zip(*per_layer)]


def run_ranks(module: torch.nn.Module, per_rank: list[tuple[dict, list]], groups: dict[str, list[list[int]]]
              ) -> list[list[torch.Tensor]]:
    """`module` called once per rank r with per_rank[r] = (its tensors, its (name, input) list), the ranks'
    collectives meeting over `groups` (name -> replica groups over ranks 0..len(per_rank)-1); looped layers
    run as a host loop (host_loop). Each rank's outputs, as a list."""
    meeting, results, errors = _Meeting(), {}, []
    # functional_call swaps tensors into the module while it runs: each rank its own copy of the module's
    # structure (the tensors themselves shared, not copied).
    shared = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    copies = [copy.deepcopy(module, dict(shared)) for _ in per_rank]

    def rank_fn(r: int) -> None:
        tensors, sample = per_rank[r]
        try:
            with torch.no_grad(), layer_loop(host_loop), _Collectives(meeting, r, groups):
                out = torch.func.functional_call(copies[r], tensors, tuple(t for _, t in sample))
            results[r] = list(out) if isinstance(out, (tuple, list)) else [out]
        except BaseException as e:  # the others stop waiting; raised below
            errors.append(e)
            meeting.fail(e)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(len(per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[r] for r in range(len(per_rank))]
