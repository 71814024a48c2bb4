"""Benchmark of `qic build` stage 1 (shard) against a plain copy of the same bytes.

    .venv/bin/python -m benchmarks.shard [--gb 4.2] [--dir artifacts/bench] [--keep] [--tiny]
    .venv/bin/python -m benchmarks.shard --smoke   # --tiny, one block, one round, no drop_caches, temporary dir

Writes (or reuses) a synthetic diffusers-layout checkpoint whose `transformer/` holds a Qwen-Image
denoiser at the real width (24 heads of 128, joint dim 3584; --tiny: the embedded tiny model's) with as
many blocks as it takes to reach --gb (decimal GB) of bf16 tensors, in ~2 GB safetensors shards plus their
index. The bytes are random but finite bf16 values, written streaming (one 32 MB chunk in memory at a time).

Then each measurement runs in a child process of its own, whose peak RSS (VmHWM of /proc/self/status
at the end of the work) is that of the work plus the interpreter and its imports; the child also
reports its RSS just before the work, so the difference is the work's own memory. (os.wait4's
ru_maxrss is not used: Linux carries the parent's high-water mark into a child across fork+exec, so a
child of a parent that imported torch would show the parent's peak.) Before every timed run the page
cache of the inputs is dropped: posix_fadvise DONTNEED on each input file, and
/proc/sys/vm/drop_caches when writable (the report says which).

Runs: `copy` (shutil.copyfile of the shard files + fsync), `pread` (a reference stream: positional
reads of each tensor into one reused 64 MB buffer, written out, source pages dropped), `bf16` (stage 1,
TP=1, no cast), `warm` (the same again: a cache hit), `f32` (TP=1, cast to float32) and `tp2` (TP=2,
bf16). They run in --repeat interleaved rounds (this shared, virtual disk is noisy); the table gives the
median and range. Every cold shard output is spot-checked against the checkpoint (first round), then
deleted.

This is a benchmark, not a test: it prints a table (and its markdown form for docs/benchmarks.md) and
asserts nothing about speed. The synthetic checkpoint is removed at the end unless --keep is given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import parse_args, smoke_dir

GENERATOR_VERSION = 1
MARKER = ".qic-bench.json"
STEM = "diffusion_pytorch_model"
FILE_TARGET = 2e9          # bytes per safetensors shard, roughly
CHUNK = 32 << 20           # bytes generated/written at a time
GB = 1e9

# diffusers QwenImageTransformer2DModel at the width of Qwen-Image; only num_layers varies.
REAL_WIDTH = {
    "_class_name": "QwenImageTransformer2DModel",
    "_diffusers_version": "0.34.0.dev0",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "out_channels": 16,
    "patch_size": 2,
}

RUNS = ("copy", "pread", "bf16", "warm", "f32", "tp2")
SHARD_RUNS = {"bf16": (1, "bfloat16"), "warm": (1, "bfloat16"), "f32": (1, "float32"), "tp2": (2, "bfloat16")}


# ------------------------------------------------------------------------------------------------------
# The synthetic checkpoint


def tiny_width() -> dict:
    """The embedded tiny preset's transformer config (--tiny, --smoke); its num_layers is replaced."""
    from qic.checkpoint.presets import preset
    return preset("tiny")["transformer"]


def transformer_config(layers: int, width: dict = REAL_WIDTH) -> dict:
    return dict(width, num_layers=int(layers))


def _tensors(layers: int, width: dict = REAL_WIDTH) -> list[tuple[str, tuple[int, ...]]]:
    from qic.checkpoint.tensor_names import transformer_tensors
    return transformer_tensors(transformer_config(layers, width))


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def layers_for(gb: float, width: dict = REAL_WIDTH) -> int:
    """Fewest blocks whose bf16 tensors total at least `gb` decimal GB."""
    base = sum(2 * _numel(s) for _, s in _tensors(0, width))
    block = sum(2 * _numel(s) for _, s in _tensors(1, width)) - base
    return max(1, math.ceil((gb * GB - base) / block))


def _groups(tensors: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Contiguous groups (in registration order, as diffusers shards) of roughly FILE_TARGET bytes."""
    total = sum(2 * _numel(s) for _, s in tensors)
    n = max(1, math.ceil(total / FILE_TARGET))
    groups: list[list] = [[] for _ in range(n)]
    acc = 0
    for name, shape in tensors:
        groups[min(n - 1, int(acc * n / total))].append((name, shape))
        acc += 2 * _numel(shape)
    return [g for g in groups if g]


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> int:
    """A bf16 safetensors file of random finite values, streamed; tensors laid out sorted by name, as
    safetensors' save_file does. Returns the file size."""
    import numpy as np

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(tensors):
        n = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        left = offset
        while left:
            k = min(CHUNK, left) // 2
            a = rng.integers(0, 1 << 16, size=k, dtype=np.uint16)
            a &= 0xBFFF  # clear the exponent's top bit: |x| < 2, never inf or NaN
            f.write(memoryview(a))
            left -= 2 * k
        f.flush()
        os.fsync(f.fileno())
        # Do not leave the freshly written checkpoint in the page cache for the first timed run.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return 8 + len(raw) + offset


def _marker(layers: int, seed: int, width: dict = REAL_WIDTH) -> dict:
    marker = {"generator": "benchmarks.shard", "generator_version": GENERATOR_VERSION, "num_layers": layers,
              "seed": seed}
    if width != REAL_WIDTH:   # (the real width's markers predate the key)
        marker["width"] = {k: v for k, v in sorted(width.items()) if k != "num_layers"}
    return marker


def checkpoint_complete(root: Path, layers: int, seed: int = 0, width: dict = REAL_WIDTH) -> bool:
    try:
        m = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = _marker(layers, seed, width)
    if {k: m.get(k) for k in [*want, "width"]} != {"width": None, **want}:
        return False
    try:
        return all((root / rel).stat().st_size == size for rel, size in m["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def write_checkpoint(root: Path, layers: int, seed: int = 0, log=print, width: dict = REAL_WIDTH) -> Path:
    """Write (or reuse) the synthetic checkpoint at root; built beside it and renamed into place."""
    import numpy as np

    from qic.checkpoint.embedded import MODEL_INDEX
    from qic.checkpoint.presets import QWEN_IMAGE_SCHEDULER

    root = Path(root).absolute()
    if checkpoint_complete(root, layers, seed, width):
        log(f"reusing the synthetic checkpoint in {root}")
        return root
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        t0 = time.perf_counter()
        _write_durable(tmp / "model_index.json", _json_bytes(MODEL_INDEX))
        (tmp / "scheduler").mkdir()
        _write_durable(tmp / "scheduler" / "scheduler_config.json", _json_bytes(QWEN_IMAGE_SCHEDULER))
        d = tmp / "transformer"
        d.mkdir()
        _write_durable(d / "config.json", _json_bytes(transformer_config(layers, width)))
        rng = np.random.default_rng(seed)
        groups = _groups(_tensors(layers, width))
        weight_map, total = {}, 0
        for k, group in enumerate(groups, 1):
            fname = f"{STEM}-{k:05d}-of-{len(groups):05d}.safetensors"
            log(f"  writing transformer/{fname} ({sum(2 * _numel(s) for _, s in group) / GB:.2f} GB)")
            _write_safetensors(d / fname, group, rng)
            weight_map.update({name: fname for name, _ in group})
            total += sum(2 * _numel(s) for _, s in group)
        _write_durable(d / f"{STEM}.safetensors.index.json",
                       _json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map}))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        marker = dict(_marker(layers, seed, width),
                      files={p.relative_to(tmp).as_posix(): p.stat().st_size for p in files})
        _write_durable(tmp / MARKER, _json_bytes(marker))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.rename(tmp, root)
        log(f"wrote the synthetic checkpoint in {time.perf_counter() - t0:.1f} s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def shard_files(root: Path) -> list[Path]:
    return sorted((root / "transformer").glob(f"{STEM}-*.safetensors"))


# ------------------------------------------------------------------------------------------------------
# Child processes: one measurement each


def _proc_io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _copy(files: list[str], out_dir: Path) -> int:
    total = 0
    for src in files:
        dst = out_dir / Path(src).name
        shutil.copyfile(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        total += os.path.getsize(dst)
    return total


def _pread_stream(files: list[str], out_dir: Path, buf_bytes: int = 64 << 20) -> int:
    """What a byte-range stream costs in Python: each tensor's range read with preadv into one reused
    buffer (in pieces when larger), written out, the source pages dropped after each tensor."""
    from qic.checkpoint.safetensors_file import read_header

    buf = bytearray(buf_bytes)
    view = memoryview(buf)
    total = 0
    for src in files:
        header = read_header(Path(src))
        with open(src, "rb", buffering=0) as fin, open(out_dir / Path(src).name, "wb", buffering=0) as fout:
            fout.write(struct.pack("<Q", len(header.raw)) + header.raw)
            for info in sorted(header.tensors.values(), key=lambda i: i.start):
                pos = info.start
                while pos < info.end:
                    k = os.preadv(fin.fileno(), [view[:min(buf_bytes, info.end - pos)]], pos)
                    if k <= 0:
                        raise OSError(f"{src}: short read")
                    fout.write(view[:k])
                    pos += k
                os.posix_fadvise(fin.fileno(), info.start, info.nbytes, os.POSIX_FADV_DONTNEED)
            os.fsync(fout.fileno())
            total += fout.tell()
    return total


def child_main(spec: dict, result_path: str) -> None:
    kind = spec["kind"]
    out_dir = Path(spec["out"])
    result: dict = {"kind": kind}
    if kind in ("copy", "pread"):
        if kind == "pread":
            import qic.checkpoint.safetensors_file  # noqa: F401  (imports before the baseline)
        out_dir.mkdir(parents=True, exist_ok=True)
        fn = _copy if kind == "copy" else _pread_stream
        work = lambda: fn(spec["files"], out_dir)  # noqa: E731
    else:
        from qic.builder.shard import shard_component
        from qic.checkpoint.reader import Checkpoint
        from qic.models.qwen_image.components import COMPONENTS

        t = time.perf_counter()
        ckpt = Checkpoint(Path(spec["ckpt"]))
        comp = COMPONENTS["denoiser"]
        config = comp.parse_config(ckpt.config(comp.folder))
        digest = ckpt.digest(components=(comp.folder,))
        result["digest_s"] = time.perf_counter() - t

        def work():
            r = shard_component(ckpt, comp, config, digest, spec["tp"], spec["dtype"], out_dir)
            result["cached"] = r.cached
            result["shard_dir"] = str(r.directory)
            result["files"] = [str(p) for p in r.files]
            return r.bytes

    result["rss_before"] = _status_kb("VmRSS") * 1024
    result["hwm_before"] = _status_kb("VmHWM") * 1024
    io0 = _proc_io()
    t0 = time.perf_counter()
    result["bytes_out"] = work()
    result["seconds"] = time.perf_counter() - t0
    result["peak_rss"] = _status_kb("VmHWM") * 1024
    io1 = _proc_io()
    result["io"] = {k: io1[k] - io0[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes") if k in io0}
    Path(result_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------------
# The parent: run children, check outputs, report


def _meminfo_kb(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def drop_caches(files: list[Path], use_proc: bool) -> str:
    """Drop the inputs' page cache before a timed run; returns the method that was used."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "posix_fadvise(DONTNEED)"
    if use_proc:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "drop_caches=1 + posix_fadvise(DONTNEED)"
        except OSError:
            pass
    return method


def run_child(spec: dict, inputs: list[Path], use_proc: bool, drop: bool = True, settle: float = 0.0) -> dict:
    method = drop_caches(inputs, use_proc) if drop else "none (warm)"
    if drop and settle:
        time.sleep(settle)  # let writeback of the previous run finish before the clock starts
    fd, result_path = tempfile.mkstemp(prefix="qic-bench-", suffix=".json")
    os.close(fd)
    try:
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cached0 = _meminfo_kb("Cached")
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.shard", "--child", json.dumps(spec), result_path],
                             env=env)
        if p.wait() != 0:
            raise SystemExit(f"benchmark child {spec['kind']} failed with exit status {p.returncode}")
        result = json.loads(Path(result_path).read_text())
    finally:
        os.unlink(result_path)
    result["cache_drop"] = method
    result["page_cache_growth"] = (_meminfo_kb("Cached") - cached0) * 1024
    return result


def verify(ckpt_root: Path, result: dict, tp: int, dtype: str) -> str:
    """Spot-check one rank's output: the largest tensor, a row-split and a column-split one."""
    import torch

    from qic.checkpoint.reader import Checkpoint
    from qic.checkpoint.safetensors_file import read_header, read_tensor
    from qic.dtypes import TORCH_DTYPES
    from qic.parallel import plans

    src = Checkpoint(ckpt_root).weights("transformer").tensors
    largest = max(src.values(), key=lambda i: i.nbytes).name
    names = [largest, "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_out.0.weight"]
    rank = tp - 1
    out = read_header(Path(result["files"][rank])).tensors
    for name in names:
        want = plans.rank_slice("denoiser", name, read_tensor(src[name]), rank, tp).to(TORCH_DTYPES[dtype])
        if not torch.equal(read_tensor(out[name]), want):
            raise SystemExit(f"output check failed: {name} on rank {rank} differs from the checkpoint")
    return f"rank {rank}: {len(names)} tensors equal"


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in _sh(["lscpu"]).splitlines()
                  if ln.startswith("Model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": model,
            "mem_gib": round(_meminfo_kb("MemTotal") / 2**20, 1)}


def disk_of(path: Path) -> str:
    out = _sh(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(path)]).split()
    if not out:
        return "unknown"
    dev, fstype = out[0], out[1] if len(out) > 1 else "?"
    name = Path(dev).name
    if name.startswith("vd"):  # a virtual machine's disk: its 'rotational' flag says nothing
        return f"{dev} ({fstype}, virtio block device)"
    rot = Path(f"/sys/block/{name}/queue/rotational")
    kind = ""
    if rot.exists():
        kind = ", rotational" if rot.read_text().strip() == "1" else ", non-rotational"
    return f"{dev} ({fstype}{kind})"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


LABELS = {
    "copy": "plain copy (shutil.copyfile + fsync)",
    "pread": "reference stream (preadv 64 MB buffer + write)",
    "bf16": "qic stage 1, TP=1, bf16",
    "warm": "qic stage 1, TP=1, bf16, warm cache",
    "f32": "qic stage 1, TP=1, -> float32",
    "tp2": "qic stage 1, TP=2, bf16",
}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _secs(s: float) -> str:
    return f"{s:.4f}" if s < 0.1 else f"{s:.2f}" if s < 10 else f"{s:.1f}"


def table(results: dict[str, list[dict]], ckpt_bytes: int, markdown: bool) -> str:
    head = ["run", "s (median)", "s (range)", "ckpt GB/s", "read GB", "from disk GB", "written GB",
            "peak RSS MiB", "RSS before MiB", "peak - before MiB", "vs copy"]
    rows = []
    copy_s = _median([r["seconds"] for r in results["copy"]]) if "copy" in results else None
    for kind, rs in results.items():
        times = [r["seconds"] for r in rs]
        s = _median(times)
        r = max(rs, key=lambda r: r["peak_rss"])
        io = rs[0].get("io", {})
        rows.append([
            LABELS[kind], _secs(s), f"{_secs(min(times))}-{_secs(max(times))}",
            f"{ckpt_bytes / GB / s:.2f}" if kind != "warm" else "-",
            f"{io.get('rchar', 0) / GB:.2f}", f"{io.get('read_bytes', 0) / GB:.2f}",
            f"{rs[0]['bytes_out'] / GB:.2f}" if kind != "warm" else "0 (hit)",
            _mb(r["peak_rss"]), _mb(r["rss_before"]), _mb(r["peak_rss"] - r["rss_before"]),
            f"{s / copy_s:.2f}x" if copy_s and kind != "warm" else "-",
        ])
    if markdown:
        rule = "|" + "|".join("---" if i == 0 else "--:" for i in range(len(head))) + "|"
        lines = ["| " + " | ".join(head) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def _load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.2,
                    help="checkpoint size to reach, decimal GB of bf16 (default 4.2)")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench"),
                    help="work directory (default artifacts/bench)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of the runs, interleaved; the table gives medians (default 3)")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait after dropping the caches, before each timed run (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for a later run")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="do not write /proc/sys/vm/drop_caches (posix_fadvise DONTNEED is still used)")
    ap.add_argument("--json", type=Path, help="also write the raw figures to this file")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model's width instead of the real one")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parse_args(ap, argv, {"tiny": True, "gb": 0.0, "dir": None, "repeat": 1, "settle": 0.0,
                                 "no_drop_caches": True})
    args.dir = args.dir or smoke_dir("shard")
    if args.child:
        child_main(json.loads(args.child[0]), args.child[1])
        return 0

    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(RUNS)}")
    if "warm" in runs and "bf16" not in runs:
        ap.error("the warm run repeats bf16: ask for both")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    command = ".venv/bin/python -m benchmarks.shard " + " ".join(argv if argv is not None else sys.argv[1:])
    work = args.dir.absolute()
    width = tiny_width() if args.tiny else REAL_WIDTH
    layers = layers_for(args.gb, width)
    ckpt_root = work / f"ckpt-{layers}L{'-tiny' if args.tiny else ''}"
    tensors = _tensors(layers, width)
    ckpt_bytes = sum(2 * _numel(s) for _, s in tensors)
    big_name, big_shape = max(tensors, key=lambda t: _numel(t[1]))
    big = 2 * _numel(big_shape)
    kind = "tiny" if args.tiny else "real"
    print(f"synthetic denoiser: {kind} width, {layers} blocks, {len(tensors)} tensors, {ckpt_bytes / GB:.2f} GB bf16")
    print(f"largest tensor: {big_name} {list(big_shape)} = {_mb(big)} MiB in bf16, {_mb(2 * big)} MiB in float32")
    ckpt_root = write_checkpoint(ckpt_root, layers, width=width)
    inputs = shard_files(ckpt_root)
    print(f"checkpoint: {len(inputs)} shard files, {sum(p.stat().st_size for p in inputs) / GB:.2f} GB, in {ckpt_root}")

    runs_dir = work / "runs"
    results: dict[str, list[dict]] = {}
    checks: dict[str, str] = {}
    loads: list[float] = []
    try:
        for rnd in range(args.repeat):
            for kind in RUNS:
                if kind not in runs:
                    continue
                out = runs_dir / ("cache-bf16" if kind in ("bf16", "warm") else kind)
                if kind != "warm" and out.exists():
                    shutil.rmtree(out)
                spec = {"kind": kind, "out": str(out), "files": [str(p) for p in inputs], "ckpt": str(ckpt_root)}
                if kind in SHARD_RUNS:
                    spec["tp"], spec["dtype"] = SHARD_RUNS[kind]
                print(f"round {rnd + 1}/{args.repeat}, {kind}: {LABELS[kind]} ...", flush=True)
                loads.append(_load1())
                r = run_child(spec, inputs, not args.no_drop_caches, drop=(kind != "warm"), settle=args.settle)
                r["load1"] = loads[-1]
                results.setdefault(kind, []).append(r)
                extra = ""
                if kind in SHARD_RUNS and kind != "warm":
                    extra = f", digest {r['digest_s'] * 1000:.0f} ms"
                    if rnd == 0:
                        checks[kind] = verify(ckpt_root, r, *SHARD_RUNS[kind])
                        extra += f", check: {checks[kind]}"
                if kind == "warm":
                    extra = f", cached={r['cached']}, read {r['io']['rchar']:,} bytes by read syscalls"
                print(f"  {r['seconds']:.4f} s, peak RSS {_mb(r['peak_rss'])} MiB "
                      f"(before work {_mb(r['rss_before'])} MiB), "
                      f"page cache {r['page_cache_growth'] / GB:+.2f} GB, {r['cache_drop']}{extra}", flush=True)
                if kind != "bf16" or "warm" not in runs:
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(ckpt_root, ignore_errors=True)
            if work.exists() and not any(work.iterdir()):
                work.rmdir()

    m = machine()
    info = {"command": command, "date": datetime.date.today().isoformat(), "machine": m,
            "disk": disk_of(work if work.exists() else work.parent), "layers": layers,
            "ckpt_bytes": ckpt_bytes, "files": len(inputs), "largest_tensor": [big_name, list(big_shape), big],
            "python": platform.python_version(), "repeat": args.repeat, "load1": [min(loads), max(loads)],
            "results": results, "checks": checks}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    print()
    print(f"{info['command']}")
    print(f"{m['cpus']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, disk {info['disk']}, {info['date']}, "
          f"Python {info['python']}, torch {info.get('torch', '?')}, 1-min load {min(loads):.1f}-{max(loads):.1f}")
    print(f"checkpoint {ckpt_bytes / GB:.2f} GB in {len(inputs)} files, largest tensor {_mb(big)} MiB; "
          f"{args.repeat} round(s), median and range of seconds; ckpt GB/s = checkpoint bytes / median s; "
          f"'read GB' counts read syscalls, 'from disk GB' block-layer reads; cache drop: "
          f"{results[next(iter(results))][0]['cache_drop']}")
    print(table(results, ckpt_bytes, markdown=False))
    print()
    print(table(results, ckpt_bytes, markdown=True))
    if args.json:
        args.json.write_text(json.dumps(info, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
