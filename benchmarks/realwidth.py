"""Real-width benchmark: qic against diffusers on a random checkpoint with the real Qwen-Image widths.

    python -m benchmarks.realwidth [--depth 1] [--resolutions 256,512] [--steps 3]
    python -m benchmarks.realwidth --plots-only      # redraw docs/img/ from artifacts/realwidth/results.json
    python -m benchmarks.realwidth --smoke           # --tiny, 48x80, 2 steps; everything (plots too) in a temp dir

In one run:
1. writes a random checkpoint in the real diffusers layout (qic.checkpoint.embedded's recipe, tokenizer
   and writer) from the real configs (tests/fixtures/qwen-image-configs) with the depth reduced: the
   transformer's num_layers, the text encoder's num_hidden_layers and its (unused) vision tower's depth.
   Widths are the real ones: 24 heads of 128, the 152064 x 3584 embedding and lm_head, the real VAE.
   The embedded tokenizer only produces ids below 1024, which a 152064-row embedding accepts;
2. `qic build` (fp32, looped, one text bucket of 128) with a fresh compile cache, its resident set
   (process + children) sampled every 0.25 s;
3. per resolution: `qic run --verbose` and a diffusers QwenImagePipeline script on the same weights
   (fp32, true CFG 4, negative prompt " ", same seed), each a fresh process: wall time from process
   start to the PNG (cold start), load and per-step times, peak RSS (the process's VmHWM);
4. a 2048^3 fp32 matmul rate, and the denoise step's FLOPs counted on fake tensors (shapes only):
   qic's graph as compiled (CFG batch 2, text padded to the bucket) and the useful work (cond and uncond
   at the prompts' own lengths, which is what diffusers computes);
5. pixel parity between the two PNGs; plots into docs/img/.
Everything is written under --dir (artifacts/realwidth), never committed. --tiny runs the same on the
embedded tiny checkpoint instead (qic.checkpoint.embedded, its own depth); a resolution is N (NxN) or HxW.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import parse_args, smoke_dir

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "qwen-image-configs"
PROMPT = "a red bicycle leaning against a blue wall"
GUIDANCE = 4.0
BUCKET = 128
SEED = 0
GiB = 1 << 30

# docs/benchmarks.md, "Depth: looped vs unrolled blocks" (benchmarks.depth --runs 7): compile seconds of the
# denoise step graph by depth; unrolled 60 was not compiled (extrapolated there: about 210 s).
DEPTH_COMPILE_SECONDS = {"looped": {4: 21.3, 16: 22.8, 60: 21.9}, "unrolled": {4: 35.9, 16: 73.7}}
UNROLLED_60_EXTRAPOLATED = 210.0


# ---------------------------------------------------------------------------------------------- checkpoint

def reduced_configs(config_dir: Path, depth: int) -> dict:
    """The real component configs with `depth` transformer blocks, text-encoder layers and vision blocks."""
    def load(folder, name="config.json"):
        return json.loads((config_dir / folder / name).read_text())
    te, tr = load("text_encoder"), load("transformer")
    tr["num_layers"] = depth
    te.update(num_hidden_layers=depth, max_window_layers=depth, torch_dtype="float32")
    vc = te["vision_config"]
    vc["depth"] = depth
    vc["fullatt_block_indexes"] = [i for i in vc.get("fullatt_block_indexes", []) if i < depth] or [depth - 1]
    return {"text_encoder": te, "transformer": tr, "vae": load("vae"),
            "scheduler": load("scheduler", "scheduler_config.json")}


def write_realwidth_checkpoint(out: Path, depth: int, config_dir: Path = CONFIGS) -> Path:
    from qic.checkpoint.embedded import write_checkpoint_from_configs
    return write_checkpoint_from_configs(out, reduced_configs(config_dir, depth), f"realwidth-depth{depth}",
                                         shards={"text_encoder": 4, "transformer": 2})


# ------------------------------------------------------------------------------------------------ measures

def run_measured(cmd: list[str], env: dict | None = None, sample: list | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of that process, output). With `sample`, appends (seconds, process RSS,
    process + descendants RSS) every 0.25 s while it runs.

    The peak is the kernel's high-water mark of the process's own memory (VmHWM), read every 0.25 s while
    it runs: wait4's ru_maxrss would not do, because a forked child starts from its parent's high-water
    mark (this process's, which held the checkpoint while writing it)."""
    import psutil
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(p.stdout.read()))
    reader.start()
    proc, hwm = psutil.Process(p.pid), 0
    while reader.is_alive():
        try:
            hwm = max(hwm, _hwm(p.pid))
            if sample is not None:
                own = proc.memory_info().rss
                kids = sum(c.memory_info().rss for c in proc.children(recursive=True))
                sample.append((time.perf_counter() - t0, own, own + kids))
        except (psutil.Error, OSError):
            break
        reader.join(0.25)
    reader.join()
    p.wait()
    wall = time.perf_counter() - t0
    out = "".join(chunks)
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{out[-4000:]}")
    return wall, hwm, out


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def step_flops(configs: dict, h: int, w: int, bucket: int, cfg: bool = True,
               lengths: tuple[int, int] | None = None) -> float:
    """FLOPs of one denoiser call at these shapes, counted by torch on fake tensors (no weights, no memory).
    lengths: the prompts' templated token counts (cond, uncond) for an exact-length graph (bucket 0), whose CFG
    step takes each branch's text at its own length (packed CFG)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from qic.builder.jobs import make_graph
    from qic.host.prompt import DROP_TOKENS
    from qic.models.qwen_image.components import COMPONENTS
    parsed = {n: c.parse_config(configs[c.folder]) for n, c in COMPONENTS.items()}
    shape = {"resolution": [h, w], "bucket": bucket} | ({} if cfg else {"cfg": False})
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = COMPONENTS["denoiser"].make_module(parsed["denoiser"], tp_size=1).eval()
        gdef = make_graph("denoiser", module, parsed, shape, "float32")
        inputs = dict(gdef.inputs)
        if lengths is not None and "negative_embeds" in inputs:
            for name, n in zip(("text_embeds", "negative_embeds"), lengths):
                inputs[name] = inputs[name].new_zeros(1, n - DROP_TOKENS, inputs[name].shape[2])
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            gdef.module.eval()(*inputs.values())
    return float(counter.get_total_flops())


def templated_lengths(ckpt: Path, prompts: list[str]) -> list[int]:
    from qic.host.prompt import apply_template
    from qic.tokenizer import load_tokenizer
    tok = load_tokenizer(ckpt / "tokenizer")
    return [len(tok.encode(apply_template(p)).ids) for p in prompts]


def pixel_diff(a: Path, b: Path) -> tuple[int, float]:
    import numpy as np
    from PIL import Image
    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.int16)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.int16)
    d = np.abs(x - y)
    return int(d.max()), float(d.mean())


def diffusers_side(ckpt: str, size: str, steps: int, png: str, device: str = "cpu", dtype: str = "float32") -> None:
    """One image with diffusers in this process; prints the per-step times as one JSON line.

    A step is diffusers' two transformer calls (cond, then uncond) and the guidance/scheduler work
    between them: from the first call's start to the second call's end. On a GPU each mark waits for
    the device first, so a mark is when the work before it finished, not when it was queued."""
    import torch
    from diffusers import QwenImagePipeline
    t = time.perf_counter()
    pipe = QwenImagePipeline.from_pretrained(ckpt, torch_dtype=getattr(torch, dtype)).to(device)
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - t
    marks: list[float] = []

    def mark(*_):
        if device == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
    pipe.transformer.register_forward_pre_hook(mark)
    pipe.transformer.register_forward_hook(mark)
    height, width = resolution(size)
    pipe(PROMPT, negative_prompt=" ", true_cfg_scale=GUIDANCE, num_inference_steps=steps, height=height, width=width,
         generator=torch.Generator("cpu").manual_seed(SEED)).images[0].save(png)
    calls = list(zip(marks[0::2], marks[1::2]))
    step_times = [calls[i + 1][1] - calls[i][0] for i in range(0, len(calls), 2)]
    print("DIFFUSERS " + json.dumps({"load": load, "steps": step_times}))


def qic_timings(output: str) -> tuple[float, list[float]]:
    """(load seconds, step seconds) from `qic run --verbose`'s timing line."""
    line = next(x for x in output.splitlines() if x.startswith("timing: "))
    parts = dict(p.split(" ") for p in line[len("timing: "):].split(", "))
    return float(parts["load"].rstrip("s")), [float(v.rstrip("s")) for k, v in parts.items() if k.startswith("step")]


# ----------------------------------------------------------------------------------------------------- run

def resolution(text: str) -> tuple[int, int]:
    """(height, width) of N (square) or HxW."""
    h, _, w = text.lower().partition("x")
    return int(h), int(w or h)


def label(key: str) -> str:
    """A resolution's axis label: 256 -> 256x256, 48x80 as it is."""
    return key if "x" in key else f"{key}x{key}"


def bench(args) -> dict:
    from benchmarks.run import matmul_gflops
    d: Path = args.dir
    d.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    res: dict = {"depth": args.depth, "steps": args.steps, "resolutions": args.resolutions, "prompt": PROMPT,
                 "device": args.device, "dtype": args.dtype, "tiny": args.tiny}

    t = time.perf_counter()
    if args.tiny:
        from qic.checkpoint.embedded import write_checkpoint
        from qic.checkpoint.presets import preset
        ckpt = write_checkpoint(d / "ckpt-tiny", "tiny")
        configs = preset("tiny")
        res["depth"] = configs["transformer"]["num_layers"]
    else:
        ckpt = write_realwidth_checkpoint(d / f"ckpt-depth{args.depth}", args.depth)
        configs = reduced_configs(CONFIGS, args.depth)
    res["checkpoint_seconds"] = time.perf_counter() - t
    res["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    print(f"checkpoint {ckpt}: {res['checkpoint_bytes'] / GiB:.2f} GiB ({res['checkpoint_seconds']:.0f} s)", flush=True)

    bundle, cache, inductor = d / "bundle", args.cache_dir or d / "cache", d / "inductor-cache"
    if not args.keep_cache:   # a cold build: this run's own caches only (never a --cache-dir given)
        for p in (bundle, inductor) if args.cache_dir else (bundle, cache, inductor):
            shutil.rmtree(p, ignore_errors=True)
    # --smoke keeps inductor's cache as inherited: it proves the path, the cold build time is not its point.
    env = dict(os.environ) if args.smoke else dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    # The dtypes go through a config file (qic build has no dtype flag); everything else as flags.
    build_config = d / "build.yaml"
    build_config.write_text(json.dumps({"dtype": {"text_encoder": args.dtype, "denoiser": args.dtype,
                                                  "vae_decoder": "float32"}}) + "\n")
    build = [py, "-m", "qic.cli", "build", str(build_config), "--model", str(ckpt), "--output", str(bundle),
             "--cache-dir", str(cache), "--text-buckets", str(BUCKET), "--device", args.device]
    for r in args.resolutions:
        build += ["--resolution", label(r)]
    samples: list = []
    wall, peak, out = run_measured(build, env=env, sample=samples)
    res["build"] = {"seconds": wall, "peak_rss": peak, "peak_total": max(x[2] for x in samples), "samples": samples,
                    "log": out[-6000:]}
    print(out[-3000:], flush=True)
    print(f"build: {wall:.0f} s, peak RSS {peak / GiB:.2f} GiB", flush=True)

    res["runs"] = {}
    # The machine's matmul rate drifts with other load (x2 within minutes here): measured before each
    # resolution and at the end, and the best of them is the rate the fractions are taken against.
    rates = []
    for r in args.resolutions:
        h, w = resolution(r)
        rates.append(matmul_gflops(args.smoke))
        png_q, png_d = d / f"qic-{r}.png", d / f"diffusers-{r}.png"
        qcmd = [py, "-m", "qic.cli", "run", str(bundle), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
                str(args.steps), "--guidance", str(GUIDANCE), "--height", str(h), "--width", str(w),
                "--output", str(png_q), "--verbose"]
        q_wall, q_peak, q_out = run_measured(qcmd)
        dcmd = [py, "-m", "benchmarks.realwidth", "--diffusers-side", str(ckpt), str(r), str(args.steps), str(png_d),
                "--device", args.device, "--dtype", args.dtype]
        d_wall, d_peak, d_out = run_measured(dcmd)
        d_json = json.loads(next(x for x in d_out.splitlines() if x.startswith("DIFFUSERS "))[len("DIFFUSERS "):])
        mx, mean = pixel_diff(png_q, png_d)
        res["runs"][r] = {
            "qic": dict(zip(("load", "steps"), qic_timings(q_out)), cold=q_wall, peak_rss=q_peak, log=q_out[-1000:]),
            "diffusers": {"cold": d_wall, "peak_rss": d_peak, "steps": d_json["steps"], "load": d_json["load"]},
            "max_diff": mx, "mean_diff": mean}
        print(f"{label(r)}: qic cold {q_wall:.1f} s, diffusers cold {d_wall:.1f} s, max/mean diff {mx}/{mean:.4f}",
              flush=True)

    lengths = templated_lengths(ckpt, [PROMPT, " "])
    res["templated_lengths"] = lengths
    rates.append(matmul_gflops(args.smoke))
    res["matmul_gflops"], res["matmul_gflops_all"] = max(rates), rates
    for r in args.resolutions:
        run = res["runs"][r]
        run["graph_flops"] = step_flops(configs, *resolution(r), BUCKET)
        run["useful_flops"] = sum(step_flops(configs, *resolution(r), n, cfg=False) for n in lengths)
    (d / "results.json").write_text(json.dumps(res, indent=1))
    return res


def table(res: dict) -> str:
    rate = res["matmul_gflops"]
    width = "tiny" if res.get("tiny") else "real"
    rows = [f"{width} width, depth {res['depth']}, {res['steps']} steps, {res.get('dtype', 'float32')} on "
            f"{res.get('device', 'cpu')}; fp32 matmul 2048^3 on the CPU: {rate:.1f} GFLOP/s (best of "
            f"{', '.join(f'{x:.0f}' for x in res.get('matmul_gflops_all', [rate]))}, measured around the runs)",
            "", "| measure | size | qic | diffusers | diffusers / qic |", "|---|---|--:|--:|--:|",
            f"| build (cold compile cache) | all | {res['build']['seconds']:.0f} s | | |",
            f"| build: peak RSS, process / with compile workers (sampled) | all | {res['build']['peak_rss'] / GiB:.2f}"
            f" / {res['build']['peak_total'] / GiB:.2f} GiB | | |"]
    for r, run in res["runs"].items():
        q, d = run["qic"], run["diffusers"]
        qs, ds = statistics.median(q["steps"]), statistics.median(d["steps"])
        gq, gu = run["graph_flops"], run["useful_flops"]
        rows += [
            f"| cold: process start to PNG | {r} | {q['cold']:.1f} s | {d['cold']:.1f} s | "
            f"{d['cold'] / q['cold']:.2f}x |",
            f"| load (qic: map + verify; diffusers: from_pretrained) | {r} | {q['load']:.2f} s | {d['load']:.2f} s | |",
            f"| denoise step (median) | {r} | {qs:.2f} s | {ds:.2f} s | {ds / qs:.2f}x |",
            f"| step GFLOP: qic's graph / useful | {r} | {gq / 1e9:.0f} / {gu / 1e9:.0f} | {gu / 1e9:.0f} | |",
            f"| achieved / matmul rate (graph FLOPs) | {r} | {gq / qs / 1e9 / rate:.0%} | | |",
            f"| achieved / matmul rate (useful FLOPs) | {r} | {gu / qs / 1e9 / rate:.0%} | "
            f"{gu / ds / 1e9 / rate:.0%} | |",
            f"| peak RSS | {r} | {q['peak_rss'] / GiB:.2f} GiB | {d['peak_rss'] / GiB:.2f} GiB | "
            f"{d['peak_rss'] / q['peak_rss']:.2f}x |",
            f"| pixel diff max / mean (of 255) | {r} | {run['max_diff']} / {run['mean_diff']:.4f} | | |"]
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------------- plots

def plots(res: dict, img: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    img.mkdir(parents=True, exist_ok=True)
    out = []

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    sizes = list(res["runs"])
    width = 0.38
    for k, side in enumerate(("qic", "diffusers")):
        ys = [statistics.median(res["runs"][s][side]["steps"]) for s in sizes]
        bars = ax.bar([i + (k - 0.5) * width for i in range(len(sizes))], ys, width, label=side)
        ax.bar_label(bars, [f"{y:.2f} s" for y in ys], padding=2)
    ax.set_xticks(range(len(sizes)), [label(s) for s in sizes])
    ax.set_xlabel("resolution (CFG batch 2, one text bucket of 128)")
    ax.set_ylabel("seconds per denoise step (median)")
    where = "2-core CPU" if res.get("device", "cpu") == "cpu" else res["device"]
    kind = "tiny" if res.get("tiny") else "real"
    ax.set_title(f"Step time, {kind} width, depth {res['depth']}, {res.get('dtype', 'float32')}, {where}")
    ax.margins(y=0.12)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    out.append(_save(fig, img / "realwidth-step-time.png"))

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for form, mark in (("looped", "o-"), ("unrolled", "s-")):
        xs = sorted(DEPTH_COMPILE_SECONDS[form])
        ax.plot(xs, [DEPTH_COMPILE_SECONDS[form][x] for x in xs], mark, label=form)
    ax.plot([16, 60], [DEPTH_COMPILE_SECONDS["unrolled"][16], UNROLLED_60_EXTRAPOLATED], "s:", color="C1",
            label="unrolled, extrapolated")
    ax.set_xlabel("transformer blocks")
    ax.set_ylabel("inductor compile seconds")
    ax.set_title("Step graph compile time vs depth (4 heads x 128, 256x256)")
    ax.legend()
    ax.grid(alpha=0.3)
    out.append(_save(fig, img / "compile-vs-depth.png"))

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    t, own, total = zip(*res["build"]["samples"])
    ax.plot(t, [x / GiB for x in total], label="qic build + children")
    ax.plot(t, [x / GiB for x in own], "--", label="qic build process")
    ax.axhline(res["checkpoint_bytes"] / GiB, color="grey", ls=":", label="checkpoint size")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("resident set, GiB")
    ax.set_title(f"Memory over `qic build`, {kind} width, depth {res['depth']}, "
                 f"{', '.join(label(r) for r in sizes)}")
    ax.legend()
    ax.grid(alpha=0.3)
    out.append(_save(fig, img / "build-memory.png"))
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.realwidth")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--resolutions", default="256,512", help="sizes, comma-separated: N (NxN) or HxW")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/realwidth"))
    ap.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    ap.add_argument("--keep-cache", action="store_true", help="reuse the bundle and compile caches of a previous run")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides run")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="text encoder and denoiser dtype on both sides (qic's VAE stays fp32)")
    ap.add_argument("--plots-only", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint instead of the real widths")
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache, kept (default: DIR/cache, emptied first)")
    ap.add_argument("--diffusers-side", nargs=4, metavar=("CKPT", "SIZE", "STEPS", "PNG"), help=argparse.SUPPRESS)
    args = parse_args(ap, argv, {"tiny": True, "resolutions": "48x80", "steps": 2, "dir": None, "img": None})
    if args.diffusers_side:
        ckpt, size, steps, png = args.diffusers_side
        return diffusers_side(ckpt, size, int(steps), png, args.device, args.dtype)
    args.dir = args.dir or smoke_dir("realwidth")
    args.img = args.img or args.dir / "img"
    args.resolutions = [f"{h}x{w}" if h != w else str(h) for h, w in map(resolution, args.resolutions.split(","))]
    res = json.loads((args.dir / "results.json").read_text()) if args.plots_only else bench(args)
    print(table(res))
    for p in plots(res, args.img):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
