"""Run a lowered graph's HLO module on XLA:CPU (torch-xla): the neuron bundle's graphs, executed exactly
as serialized, on a machine without Neuron hardware. Run side: imports torch, torch.distributed and
torch-xla only.

One rank: weights move to the XLA device once, at load; each call moves the inputs and reads the
outputs back.

Several ranks (a TP, Ulysses or CFG-parallel bundle, one process per rank as `qic run` spawns them): the
graphs' collectives must meet on devices of one XLA client, and one client cannot span processes. So
rank 0's process holds `world` XLA:CPU devices and runs every rank's graph, rank r's on device r, all at
once (execute_ranks); the other ranks hand rank 0 their weights once, at load, and their inputs on every
call, over a gloo group of their own, and get their outputs back. The ranks call their graphs in the same
order (the runtime is SPMD), which each call checks.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")


def _check_compile_flags() -> None:
    """XLA:CPU is where qic checks a lowered graph (the build's check, `qic run --device xla-cpu`), not where it
    serves, so its graphs compile at XLA's backend optimization level 0 unless XLA_FLAGS names a level: the tiny
    model's three graphs compiled in 1.0 s instead of 2.7 s, and their 4 steps ran in 0.12 s instead of 0.08 s. The
    HLO is the same (the flag is the CPU back end's code generation; neuronx-cc reads the saved module), and the
    checks' figures moved by rounding only (the tiny step's rel-L2 against eager 1.23e-6 -> 1.35e-6). XLA reads
    XLA_FLAGS once, at its first compile, which is after this module's import."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


_check_compile_flags()


def reserve_devices(n: int) -> None:
    """At least n XLA:CPU devices in this process (a multi-rank graph runs rank r on device r): torch-xla
    reads CPU_NUM_DEVICES once, when its runtime starts, so this must come before any XLA tensor."""
    import torch_xla
    if not torch_xla._XLAC._xla_runtime_is_initialized() and n > int(os.environ.get("CPU_NUM_DEVICES", "1")):
        os.environ["CPU_NUM_DEVICES"] = str(n)


def load(hlo: Path, params: list[list], weights: list[torch.Tensor], rank: int = 0, world: int = 1):
    """`params`: per HLO parameter ["input", i] or ["weight", j] (params.json); a callable over the
    graph's inputs returning its outputs as CPU tensors."""
    if world > 1:
        return _load_rank(Path(hlo), params, weights, rank, world)
    import torch_xla
    run_hlo = _runner(Path(hlo).read_bytes(), f"qic::{Path(hlo).parent.name}")
    device = torch_xla.device()
    bound = {j: _to_device(weights[j], device) for kind, j in params if kind == "weight"}

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:   # 0-dim inputs as the ranks' path moves them
        return run_hlo([_to_device(inputs[i], device) if kind == "input" else bound[i] for kind, i in params])

    return run


def run_once(proto: bytes, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter given, as CPU tensors in parameter order (the build's check)."""
    import torch_xla
    device = torch_xla.device()
    return _runner(proto, "qic::graph")([_to_device(v, device) for v in values])


def _runner(proto: bytes, op: str):
    import torch_xla
    import torch_xla.core.xla_builder as xb
    computation = xb.computation_from_module_proto("qic_graph", proto)
    return lambda args: [o.cpu() for o in torch_xla._XLAC._xla_user_computation(op, args, computation)]


# ------------------------------------------------------------------------------------------ several ranks

def execute_ranks(proto: bytes, per_rank: list[list[torch.Tensor]],
                  name: str = "qic_graph") -> list[list[torch.Tensor]]:
    """Run one HLO module on len(per_rank) XLA:CPU devices at once, rank r with per_rank[r] as its
    parameters (CPU tensors, or XLA tensors already on device r), so its collectives really combine the
    ranks. Needs CPU_NUM_DEVICES >= ranks set before torch-xla starts (reserve_devices).

    One thread per device. Each device's run must come from one compiled executable: compiled twice,
    the CPU runtime gives the copies different collective ids and their all-reduces never meet (seen
    with torch-xla 2.9). So the first time a module runs, rank 0 starts alone and the others start once
    the compilation cache holds its executable; they find it there and join rank 0's collectives. The
    parameters are on their devices before any thread starts, so the ranks meet well inside the
    runtime's 10 s rendezvous limit.
    """
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model as xm
    ranks = len(per_rank)
    devices = [torch_xla.device(r) for r in range(ranks)]
    if len({str(d) for d in devices}) != ranks:
        raise RuntimeError(f"{ranks} ranks need CPU_NUM_DEVICES >= {ranks} set before torch-xla starts")
    computation = xb.computation_from_module_proto(name, proto)
    on_device = [[_to_device(p, devices[r]) for p in per_rank[r]] for r in range(ranks)]
    key = hashlib.sha256(proto + repr([(tuple(p.shape), p.dtype) for p in per_rank[0]]).encode()).hexdigest()
    first_time = key not in _EXECUTED
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def rank_fn(r: int) -> None:
        try:
            torch_xla._XLAC._xla_set_default_device(str(devices[r]))
            xm.set_replication(devices[r], [str(d) for d in devices])
            outs = torch_xla._XLAC._xla_user_computation(f"qic::{name}", on_device[r], computation)
            # All outputs in one execution: fetched one by one, each .cpu() would compile its own graph
            # (the module plus one output) on each rank, and those copies' collectives never meet.
            torch_xla._XLAC._xla_sync_multi(list(outs), [str(devices[r])], True)
            results[r] = [o.cpu() for o in outs]
        except BaseException as e:  # surfaced below, after every thread ended
            errors.append(e)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(ranks)]
    compiled = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
    threads[0].start()
    while first_time and threads[0].is_alive() and \
            torch_xla._XLAC._xla_get_num_cached_compilation_graph() == compiled:
        time.sleep(0.02)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    _EXECUTED.add(key)
    return [results[r] for r in range(ranks)]


_EXECUTED: set[str] = set()


_EXECUTED: set[str] = set()


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A 0-dim input moves as a 1-element tensor viewed back to 0-dim: moved as is, torch-xla's graph hash
    of the step graph changed with the scalars' values (torch-xla 2.9: sigma 1.0 is a "special scalar", baked
    in as a constant, and the timestep's value changed the hash too), so a call at a new step compiled anew,
    and at several ranks each device's thread compiled its own copy, whose collectives never met."""
    if t.dim() == 0 and t.device.type == "cpu":
        return t.reshape(1).to(device).reshape(())
    return t.to(device)


_GROUP: dict = {}          # the gloo group the ranks' graph calls travel over, made at the first load
_LOADS = [0]               # graphs loaded by this rank: a graph's number is the same on every rank


def _load_rank(hlo: Path, params: list[list], weights: list[torch.Tensor], rank: int, world: int):
    """Rank `rank`'s handle on a graph every rank of `world` loads at the same point: rank 0 runs it for all."""
    import datetime

    import torch.distributed as dist

    from qic.parallel.ranks import new_group
    if "group" not in _GROUP:   # collective: every rank makes it at its first graph
        # Rank 0 compiles (minutes, on XLA:CPU) and runs every rank's HLO while the others wait on this group:
        # it waits longer than the graphs' collectives; a dead rank 0 still ends the run (its socket closes).
        _GROUP["group"] = new_group(list(range(world)), timeout=datetime.timedelta(minutes=30), backend="gloo")
    group = _GROUP["group"]
    number = _LOADS[0] = _LOADS[0] + 1
    mine = {j: weights[j] for kind, j in params if kind == "weight"}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    inputs_used = [i for kind, i in params if kind == "input"]
    if rank == 0:
        reserve_devices(world)
        import torch_xla
        proto = hlo.read_bytes()
        bound = [{j: t.to(torch_xla.device(r)) for j, t in gathered[r].items()} for r in range(world)]

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        call = (number, [inputs[i] for i in inputs_used])
        calls = [None] * world if rank == 0 else None
        dist.gather_object(call, calls, dst=0, group=group)
        replies = None
        if rank == 0:
            try:
                numbers = [c[0] for c in calls]
                if len(set(numbers)) > 1:
                    raise RuntimeError(f"{hlo.parent.name}: the ranks called different graphs (graph numbers "
                                       f"{numbers}): a layout whose ranks leave lockstep cannot run on XLA:CPU")
                per_rank = []
                for r, (_, given) in enumerate(calls):
                    feed = iter(given)
                    per_rank.append([next(feed) if kind == "input" else bound[r][i] for kind, i in params])
                replies = execute_ranks(proto, per_rank, hlo.parent.name)
            except Exception as e:   # every rank gets the error, none waits forever
                replies = [f"{type(e).__name__}: {e}"] * world
        got = [None]
        dist.scatter_object_list(got, replies, src=0, group=group)
        if isinstance(got[0], str):
            raise RuntimeError(f"XLA:CPU (rank 0 runs every rank's graph): {got[0]}")
        return got[0]

    return run

