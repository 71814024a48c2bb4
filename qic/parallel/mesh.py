"""The device mesh of one image: tensor parallelism x Ulysses sequence parallelism x CFG-parallel.

Layout (docs/parallelism.md): world = tp x ulysses x cfg, with TP innermost, then Ulysses, then CFG:

    rank = (c * ulysses + u) * tp + t        c: CFG branch (0 cond, 1 uncond), u: sequence shard, t: TP rank

so a TP group is tp consecutive ranks (the group that all-reduces every block, kept on the closest devices),
a Ulysses group is the ranks of equal (c, t), and a CFG group the two ranks of equal (u, t). Ranks of equal t
hold the same TP weight shard: a bundle keeps tp shard files whatever the world.

The graphs name their groups by a fixed alias per axis ("qic:tp", "qic:sp", "qic:cfg"), not by the
process-group counter's names, which differ from group to group: `join` registers each rank's own groups
under the aliases, so one compiled graph serves every rank. A plain TP layout keeps the world group's name
("0") for its TP axis, as TP bundles always had. Run-time safe: torch.distributed only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from qic.errors import ConfigError
from qic.parallel.ranks import new_group

AXES = ("tp", "sp", "cfg")   # innermost first
ALIASES = {"tp": "qic:tp", "sp": "qic:sp", "cfg": "qic:cfg"}
# A step graph's inputs that the runtime fills itself: this rank's coordinate on the axis the graph splits over.
RANK_INPUTS = {"cfg_rank": "cfg", "sp_rank": "sp"}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ulysses: int = 1
    cfg: int = 1          # 2 with CFG-parallel

    @property
    def world(self) -> int:
        return self.tp * self.ulysses * self.cfg

    @property
    def plain(self) -> bool:
        """Tensor parallelism only (or one rank): the world group is the TP group."""
        return self.ulysses == 1 and self.cfg == 1

    def size(self, axis: str) -> int:
        return {"tp": self.tp, "sp": self.ulysses, "cfg": self.cfg}[axis]

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the layout's world of {self.world}")
        return {"tp": rank % self.tp, "sp": rank // self.tp % self.ulysses, "cfg": rank // (self.tp * self.ulysses)}

    def rank_of(self, tp: int, sp: int, cfg: int) -> int:
        return (cfg * self.ulysses + sp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each a list of world ranks in the axis' order (the replica groups of
        that axis' collectives)."""
        others = [a for a in AXES if a != axis]
        out = []
        for i in range(self.world // self.size(axis)):
            fixed = {}
            for a in others:
                fixed[a], i = i % self.size(a), i // self.size(a)
            out.append([self.rank_of(**(fixed | {axis: k})) for k in range(self.size(axis))])
        return sorted(out)

    def group_name(self, axis: str) -> str:
        """The name the graphs' collectives over `axis` carry."""
        return "0" if axis == "tp" and self.plain else ALIASES[axis]

    def describe(self) -> str:
        parts = [f"TP {self.tp}"] + ([f"Ulysses {self.ulysses}"] if self.ulysses > 1 else []) \
            + (["CFG-parallel 2"] if self.cfg > 1 else [])
        return " x ".join(parts) + f" (world {self.world})"

    def as_dict(self) -> dict:
        return {"tp": self.tp, "ulysses": self.ulysses, "cfg": self.cfg, "world": self.world}

    @classmethod
    def of_manifest(cls, manifest: dict) -> Layout:
        d = manifest.get("layout") or {}
        return cls(manifest["tp"], d.get("ulysses", 1), d.get("cfg", 1))


_JOINED: dict[int, Layout] = {}   # id of the default process group -> the layout joined on it


def join(layout: Layout) -> None:
    """Create the layout's process groups (every rank calls this, in the same order, before any other
    new_group) and register this rank's groups under the axis aliases; and the host's exchange groups
    (host_group). Idempotent per process group; nothing to do on one rank."""
    if layout.world == 1 or (layout.plain and not dist.is_initialized()):
        return   # plain TP without a process group: a rank's weights loaded alone (neuron's per-rank load)
    if not dist.is_initialized():
        raise ConfigError(f"the bundle's layout {layout.describe()} needs a torch.distributed process group")
    if dist.get_world_size() != layout.world:
        raise ConfigError(f"the bundle's layout {layout.describe()} needs {layout.world} ranks, "
                          f"but {dist.get_world_size()} run it")
    world_group = dist.group.WORLD
    joined = _JOINED.get(id(world_group))
    if joined == layout:
        return
    if joined is not None:
        raise ConfigError(f"this process already joined the layout {joined.describe()}")
    from torch._C._distributed_c10d import _register_process_group
    me = dist.get_rank()
    if not layout.plain:   # plain TP: the graphs use the world group ("0")
        for axis in AXES:
            for ranks in layout.groups(axis):
                group = new_group(ranks)
                if me in ranks:
                    _register_process_group(ALIASES[axis], group)
                    _MINE[axis] = group
    # The host's own groups, apart from the graphs' (on a graph's group, a host collective between two graph
    # calls left the next graph's collectives waiting: gloo, torch 2.13). "world": every rank; "branch": the
    # ranks of this rank's CFG group (the world without CFG-parallel).
    _HOST["world"] = new_group(list(range(layout.world)))
    _HOST["branch"] = _HOST["world"]
    if layout.cfg > 1:
        for c in range(layout.cfg):
            ranks = [r for r in range(layout.world) if layout.coords(r)["cfg"] == c]
            group = new_group(ranks)
            if me in ranks:
                _HOST["branch"] = group
    _JOINED[id(world_group)] = layout


_MINE: dict = {}   # axis -> this rank's process group on it
_HOST: dict = {}   # "world" / "branch" -> this rank's host-side exchange group (join)


def host_group(peers: str):
    """The gloo group for host-side exchanges among `peers` ("world" or "branch": this rank's CFG group)."""
    return _HOST[peers]


def share_from(layout: Layout, axis: str, x, coord: int = 0):
    """Host side: the tensor of the rank at `coord` on `axis` (of this rank's group), on every rank of the
    group (x: this rank's tensor of the same shape and dtype, its values unused unless it is that rank)."""
    import torch
    me = layout.coords(dist.get_rank())
    y = x.float().contiguous()   # gloo's broadcast and every dtype the latents may have
    dist.broadcast(y, src=layout.rank_of(**(me | {axis: coord})), group=_MINE[axis])
    return y.to(x.dtype) if x.dtype != torch.float32 else y


_EVENTS = [0]   # host waits so far (wait_for_group / group_done): the same count on every rank


def _event_key(rank: int) -> str:
    _EVENTS[0] += 1
    return f"qic:done:{_EVENTS[0]}:{rank}"


def group_done() -> None:
    """Host side: tell the ranks waiting in wait_for_group on this rank that it is done (no collective)."""
    dist.distributed_c10d._get_default_store().set(_event_key(dist.get_rank()), "1")


def wait_for_group(layout: Layout, axis: str, coord: int, poll: float = 0.02) -> None:
    """Host side, for a rank with nothing to compute: wait until the rank at `coord` on `axis` of its group calls
    group_done, polling the process group's store rather than sitting in a collective, whose timeout (qic's,
    seconds) a whole denoise loop outlasts. A peer that dies takes the store's host (rank 0) or rank 0's next
    collective with it, so the poll fails rather than waiting forever."""
    import time
    me = layout.coords(dist.get_rank())
    key = _event_key(layout.rank_of(**(me | {axis: coord})))
    store = dist.distributed_c10d._get_default_store()
    while not store.check([key]):
        time.sleep(poll)
    store.delete_key(key)


def gather_objects(peers: str, obj) -> list:
    """Host side: every rank's `obj` (picklable) among `peers` (host_group), in rank order."""
    out = [None] * dist.get_world_size(_HOST[peers])
    dist.all_gather_object(out, obj, group=_HOST[peers])
    return out


def from_each_branch(layout: Layout, x):
    """Host side: the tensor x of each CFG group's first rank (TP 0, Ulysses 0), in CFG order, on every rank (one
    all_gather on the host's world group; every rank gives a tensor of the same shape and dtype)."""
    import torch
    out = [torch.empty_like(x) for _ in range(layout.world)]
    dist.all_gather(out, x.contiguous(), group=_HOST["world"])
    return [out[layout.rank_of(0, 0, c)] for c in range(layout.cfg)]


def gather_figures(peers: str, figures: list[float]):
    """Host side: every rank's step-cache figures among `peers`, as a [ranks, rows] float64 tensor in rank order
    (equal row counts on every rank: one call a step, so a tensor, not pickled objects)."""
    import torch
    mine = torch.tensor(figures, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(_HOST[peers]))]
    dist.all_gather(out, mine, group=_HOST[peers])
    return torch.stack(out)


def fake_join(layout: Layout) -> None:
    """For tracing (a fake process group of the layout's world, rank 0): the aliases resolve to groups of the
    right sizes, which compilers may ask for."""
    from torch._C._distributed_c10d import _register_process_group
    for axis in AXES:
        _register_process_group(ALIASES[axis], new_group(layout.groups(axis)[0]))
