"""Stage 1: extract each component's tensors into per-rank safetensors, streaming, one tensor at a time.

Peak memory is a small multiple of the largest tensor, never the model: each output file's header is
computed up front (converting meta tensors), then tensors are read by positional reads, converted,
sliced for the rank, cast, written and dropped. Results live in a content-addressed cache keyed by a
cheap checkpoint digest, the component, the plan and converter code, TP and dtype: a repeat build
reads no tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from qic import __version__
from qic.builder import lora as lora_module
from qic.builder.components import expected_tensors, source_digest
from qic.builder.lora import lora_key, merge
from qic.cache import layout
from qic.checkpoint.reader import Checkpoint
from qic.checkpoint.safetensors_file import DTYPE_NAMES
from qic.dtypes import TORCH_DTYPES
from qic.errors import CheckpointError
from qic.family import Component
from qic.fsutil import leftover_name, staging_dir, write_json_atomic
from qic.parallel import plans


@dataclass(frozen=True)
class ShardResult:
    key: str
    directory: Path
    files: tuple[Path, ...]       # one per rank
    cached: bool
    bytes: int


def shard_key(ckpt_digest: str, component: Component, tp: int, dtype: str, looped: bool = False,
              loras: tuple = ()) -> str:
    h = hashlib.sha256()
    if loras:  # merged weights: their own entry (LoRA file digests and scales, in merge order)
        h.update(b"lora\0" + lora_key(list(loras)).encode() + b"\0" + Path(lora_module.__file__).read_bytes())
    for part in (b"qic-shard-v1", ckpt_digest.encode(), component.name.encode(), str(tp).encode(), dtype.encode(),
                 b"looped" if looped else b"unrolled",
                 plans.plan_text(component.name).encode(),
                 source_digest(component)):
        h.update(part + b"\0")
    return h.hexdigest()[:32]


def shard_component(ckpt: Checkpoint, component: Component, config, ckpt_digest: str, tp: int, dtype: str,
                    cache_dir: Path, progress=None, looped: bool = False, loras: tuple = ()) -> ShardResult:
    """Per-rank safetensors for one component, from the cache when present and intact.

    looped: block weights are written stacked ([num_layers, ...], see qic.models.looped) for graphs
    that loop over one block. loras: checked LoRAs (qic.builder.lora) merged into the checkpoint tensors
    they target, in fp32, before conversion, TP split and cast.
    """
    dtype = component.run_dtype(dtype)
    looped = looped and component.stackable
    key = shard_key(ckpt_digest, component, tp, dtype, looped, loras)
    final = layout.shard_dir(cache_dir, component.name, key)
    with layout.shard_lock(cache_dir, key):
        hit = _intact(final, tp)
        if hit:
            return ShardResult(key, final, hit, True, sum(p.stat().st_size for p in hit))
        entries = _plan(ckpt, component, config, tp, dtype)
        plan = _groups(entries, component, config, tp, looped)
        full_shapes = {e.name: e.shape for e in entries}
        extras = [plans.rank_tensors(component.name, full_shapes, rank, tp) for rank in range(tp)]
        with staging_dir(final) as tmp:
            files = [tmp / f"rank{rank}.safetensors" for rank in range(tp)]
            _write_ranks(files, plan, extras, ckpt.weights(component.folder).tensors, component,
                         TORCH_DTYPES[dtype], progress, list(loras))
            stamps = {p.name: _stamp(p) for p in files}
            write_json_atomic(tmp / "meta.json", {"component": component.name, "tp": tp, "dtype": dtype,
                                                  "qic": __version__, "files": stamps})
    files = tuple(final / f"rank{r}.safetensors" for r in range(tp))
    return ShardResult(key, final, files, False, sum(p.stat().st_size for p in files))


def _stamp(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns]


def _intact(final: Path, tp: int) -> tuple[Path, ...] | None:
    """A cached entry is used only if every rank file is there with the size and mtime it was written
    with (a file edited in place, e.g. through a bundle's hard link, makes it a miss). A hit touches
    meta.json: its mtime is the entry's last use, for `qic cache prune`."""
    if not final.is_dir():
        return None
    meta_path = final / "meta.json"
    try:
        stamps = json.loads(meta_path.read_text())["files"]
        files = tuple(final / f"rank{r}.safetensors" for r in range(tp))
        if all(p.is_file() and _stamp(p) == stamps[p.name] for p in files):
            try:
                os.utime(meta_path)
            except OSError:   # a read-only cache: no record of use, still a hit
                pass
            return files
    except (OSError, KeyError, ValueError, TypeError):
        pass
    # Damaged (no or bad meta.json, a rank file missing or edited): move it aside so that the rebuild can
    # take its place; left in place, the rebuild's staging dir could never be renamed over it.
    os.rename(final, final.with_name(leftover_name(".tmp", final.name, "damaged")))
    return None


@dataclass(frozen=True)
class _Entry:
    source: str          # checkpoint tensor name
    name: str            # module tensor name
    shape: tuple         # full (TP=1) shape after conversion


def _plan(ckpt: Checkpoint, component: Component, config, tp: int, dtype: str) -> list[_Entry]:
    """Map checkpoint tensors to module tensors using meta tensors; refuse missing/unexpected ones."""
    weights = ckpt.weights(component.folder)
    infos = weights.tensors
    entries = []
    for src in sorted(infos):
        info = infos[src]
        meta = torch.empty(info.shape, dtype=info.torch_dtype, device="meta")
        for name, t in component.convert({src: meta}).items():
            entries.append(_Entry(src, name, tuple(t.shape)))
    full = expected_tensors(component, config, 1)
    have = {e.name: e for e in entries}
    missing = sorted(set(full) - set(have))
    unexpected = sorted(set(have) - set(full))
    if missing:
        raise CheckpointError(f"{weights.directory}: missing tensor {missing[0]}"
                              + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{weights.directory}: unexpected tensor {have[unexpected[0]].source}"
                              + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for e in entries:
        if e.shape != full[e.name]:
            raise CheckpointError(f"{weights.directory}: tensor {e.source} has shape {e.shape}, "
                                  f"the config implies {full[e.name]}")
    per_rank = expected_tensors(component, config, tp)  # raises a ConfigError naming counts if tp does not divide
    derived = sorted(set(per_rank) - set(full))
    if tp > 1 and derived != sorted(component.tp_plan.rank_tensors):
        raise CheckpointError(f"{component.name}: the TP={tp} model holds {derived}, which the plan's per-rank "
                              f"tensors {sorted(component.tp_plan.rank_tensors)} do not provide")
    for e in entries:
        sliced = plans.rank_slice(component.name, e.name, torch.empty(e.shape, device="meta"), 0, tp)
        if tuple(sliced.shape) != per_rank[e.name]:
            raise CheckpointError(f"TP plan for {component.name} gives {e.name} shape {tuple(sliced.shape)} on "
                                  f"a rank, the model expects {per_rank[e.name]}")
    return sorted(entries, key=lambda e: e.name)


@dataclass(frozen=True)
class _Group:
    """One output tensor: a single module tensor, or layer tensors stacked in layer order."""
    name: str
    entries: tuple[_Entry, ...]
    stacked: bool


def _groups(entries: list[_Entry], component: Component, config, tp: int, looped: bool) -> list[_Group]:
    if not looped:
        return [_Group(e.name, (e,), False) for e in entries]
    from qic.models.looped import stacked_name
    stacks: dict[str, list] = {}
    groups = []
    for e in entries:
        hit = stacked_name(e.name, component.blocks)
        if hit is None:
            groups.append(_Group(e.name, (e,), False))
        else:
            stacks.setdefault(hit[0], []).append((hit[1], e))
    for name, items in stacks.items():
        groups.append(_Group(name, tuple(e for _, e in sorted(items, key=lambda x: x[0])), True))
    expected = expected_tensors(component, config, tp, looped=True)
    for g in groups:
        shape = _rank_shape(component, g, 0, tp)
        if expected.get(g.name) != shape:
            raise CheckpointError(f"{component.name}: stacked tensor {g.name} would be {shape}, "
                                  f"the looped model expects {expected.get(g.name)}")
    return sorted(groups, key=lambda g: g.name)


def _header(plan: list[_Entry], extras: dict[str, torch.Tensor], component: Component, rank: int, tp: int,
            dtype: torch.dtype) -> bytes:
    """The rank file's header: the plan's tensors in order, then the rank's own extra tensors."""
    items = [(e.name, dtype, _rank_shape(component, e, rank, tp)) for e in plan]
    items += [(name, t.dtype, tuple(t.shape)) for name, t in extras.items()]
    header, offset = {}, 0
    for name, dt, shape in items:
        nbytes = dt.itemsize * _numel(shape)
        header[name] = {"dtype": DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def _rank_shape(component: Component, g, rank: int, tp: int) -> tuple:
    """A rank's shape of an entry or group: a stack is its layers' rank shapes behind a layer dim."""
    if isinstance(g, _Group):
        one = _rank_shape(component, g.entries[0], rank, tp)
        return (len(g.entries), *one) if g.stacked else one
    return tuple(plans.rank_slice(component.name, g.name, torch.empty(g.shape, device="meta"), rank, tp).shape)


def _write_ranks(paths: list[Path], plan: list[_Entry], extras: list[dict], infos: dict, component: Component,
                 dtype: torch.dtype, progress, loras: list | None = None) -> None:
    """One pass over the source tensors writes every rank's file: each tensor is read once, into one
    reused buffer, and its source pages are dropped from the page cache after use."""
    tp = len(paths)
    reader = _Reader(max((infos[e.source].nbytes for g in plan for e in g.entries), default=0))
    outs = [open(p, "wb") for p in paths]
    try:
        for rank, f in enumerate(outs):
            f.write(_header(plan, extras[rank], component, rank, tp, dtype))
        # In offset order, one tensor in memory at a time; a stack is its layers written back to back.
        for e in (e for g in plan for e in g.entries):
            t = component.convert({e.source: merge(e.source, reader.read(infos[e.source]), loras or [])})[e.name]
            for rank, f in enumerate(outs):
                part = plans.rank_slice(component.name, e.name, t, rank, tp).to(dtype).contiguous()
                assert tuple(part.shape) == _rank_shape(component, e, rank, tp), e.name
                if part.numel():
                    f.write(memoryview(part.view(torch.uint8).numpy()))
                if progress:
                    progress(part.numel() * dtype.itemsize)
            del t, part
        for rank, f in enumerate(outs):  # after the streamed tensors, as the header orders them
            for t in extras[rank].values():
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
        for f in outs:
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in outs:
            f.close()
        reader.close()


class _Reader:
    """Positional reads into one reused buffer (a tensor returned is valid until the next read)."""

    def __init__(self, capacity: int):
        self.buf = bytearray(max(capacity, 1))
        self.files: dict[Path, int] = {}

    def read(self, info) -> torch.Tensor:
        fd = self.files.get(info.path)
        if fd is None:
            fd = self.files[info.path] = os.open(info.path, os.O_RDONLY)
        view = memoryview(self.buf)[:info.nbytes]
        got = 0
        while got < info.nbytes:
            k = os.preadv(fd, [view[got:]], info.start + got)
            if k <= 0:
                raise CheckpointError(f"{info.path}: truncated while reading tensor {info.name}")
            got += k
        if hasattr(os, "posix_fadvise"):  # the source is read once: keep it out of the page cache
            os.posix_fadvise(fd, info.start, info.nbytes, os.POSIX_FADV_DONTNEED)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        return torch.frombuffer(self.buf, dtype=info.torch_dtype, count=info.nbytes // info.torch_dtype.itemsize
                                ).view(info.shape)

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
