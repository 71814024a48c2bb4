"""Step caching: per-image time, steps computed and PSNR against the uncached image, qic and diffusers side by side.

    python -m benchmarks.step_cache [--models shapes,realwidth] [--steps 20,50] [--dir artifacts/step-cache]
    python -m benchmarks.step_cache --plots-only     # redraw docs/img/step-cache.png from docs/img/step-cache.json
    python -m benchmarks.step_cache --smoke          # the embedded tiny model, 48x80, 3 steps, export, in a temp dir

In one run, per model (the trained embedded:shapes at 128x128; the real-width random checkpoint of
benchmarks.realwidth at --realwidth-depth blocks and 128x128; --smoke: the tiny random one):
1. `qic build --step-cache 1,0` (FirstBlockCache's split) of the checkpoint;
2. per step count: the uncached image (qic: the whole-step graph; diffusers: no cache), a probe run whose
   per-step figures give three thresholds (their 25th, 50th and 75th percentiles, so each caches some steps
   but not all), then qic `--cache-threshold` against diffusers' FirstBlockCache at each, and one static mask
   (first 4 steps, every other one, the last 2) as qic `--cache-steps` against cache-dit's DBCache (Fn 1, Bn 0)
   with the same steps_computation_mask and the static policy;
3. each image's time (qic: generate() in process; diffusers: the pipeline call; the same prompt, seed, true
   CFG 4 and negative prompt " ", fp32, this process's threads), the steps each branch computed and the PSNR
   against its own side's uncached image;
4. a table and docs/img/step-cache.png (time against PSNR); the figures go to docs/img/step-cache.json, where a
   run replaces only the rows of the models and step counts it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import parse_args, smoke_dir
from qic.fsutil import write_bytes_atomic

REPO = Path(__file__).resolve().parents[1]
GUIDANCE, SEED = 4.0, 0
PROMPTS = {"shapes": "a yellow square on a blue background", "realwidth": "a red bicycle leaning against a blue wall",
           "tiny": "a red bicycle"}


# ------------------------------------------------------------------------------------------ the references

def diffusers_pipe(root):
    from diffusers import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipe_call(pipe, prompt, steps, height, width, seed=SEED, guidance=GUIDANCE):
    return pipe(prompt, negative_prompt=" ", true_cfg_scale=guidance, num_inference_steps=steps, height=height,
                width=width, generator=torch.Generator("cpu").manual_seed(seed)).images[0]


def fbc_reference(pipe, threshold, prompt, steps, height, width, seed=SEED, guidance=GUIDANCE):
    """diffusers' FirstBlockCache: (image, {"cond": computed steps, "uncond": ...}), read from the head block
    hook's per-context state after each transformer call (the pipeline calls cond, then uncond; at guidance
    <= 1 cond only, and "uncond" stays empty)."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
    tr = pipe.transformer
    tr.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    hook = tr.transformer_blocks[0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
    computed, calls = {"cond": [], "uncond": []}, {"cond": 0, "uncond": 0}

    def after(module, inputs, output):
        name = hook.state_manager.context.name
        if hook.state_manager.get_state().should_compute:
            computed[name].append(calls[name])
        calls[name] += 1

    handle = tr.register_forward_hook(after)
    try:
        image = pipe_call(pipe, prompt, steps, height, width, seed, guidance)
    finally:
        handle.remove()
        tr.disable_cache()
    return image, computed


def dbcache_reference(pipe, steps, prompt, height, width, seed=SEED, **config):
    """cache-dit's DBCache: (image, computed steps per branch) from its own per-branch stats."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")   # read when cache_dit is first imported
    import cache_dit
    from cache_dit import DBCacheConfig
    cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(**config))
    try:
        image = pipe_call(pipe, prompt, steps, height, width, seed)
        cached, cfg_cached = list(pipe.transformer._cached_steps), list(pipe.transformer._cfg_cached_steps)
    finally:
        cache_dit.disable_cache(pipe)   # it patches QwenImagePipeline.__call__ for the whole process until then
    return image, {"cond": [i for i in range(steps) if i not in cached],
                   "uncond": [i for i in range(steps) if i not in cfg_cached]}


# ------------------------------------------------------------------------------------------ measures

def psnr(a, b) -> float:
    """dB over 8-bit pixels; identical images: inf."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def static_mask(steps: int) -> list[int]:
    """The first 4 steps, every other one after, and the last 2: about 60% of the steps computed."""
    return sorted(set(range(min(4, steps))) | set(range(4, steps, 2)) | set(range(max(0, steps - 2), steps)))


def thresholds_from(figures: list[list], count: int = 3) -> list[float]:
    """Quartiles of the probe's per-step figures (every row, every step that had one)."""
    values = sorted(f for row in figures for f in row if f is not None)
    return [round(float(np.quantile(values, q)), 4) for q in np.linspace(0, 1, count + 2)[1:-1]]


def checkpoint(model: str, work: Path, depth: int) -> tuple[Path, tuple[int, int]]:
    from qic.checkpoint.embedded import write_checkpoint
    if model == "realwidth":
        from benchmarks.realwidth import write_realwidth_checkpoint
        return write_realwidth_checkpoint(work / f"ckpt-realwidth-{depth}", depth), (128, 128)
    if model == "tiny":
        return write_checkpoint(work / "ckpt-tiny", "tiny"), (48, 80)
    return write_checkpoint(work / "ckpt-shapes", "shapes"), (128, 128)


def build(ckpt: Path, res, bucket: int, out: Path, cache_dir: Path, backend: str) -> Path:
    subprocess.run([sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--resolution",
                    "{}x{}".format(*res), "--text-buckets", str(bucket), "--step-cache", "1,0", "--cache-dir",
                    str(cache_dir), "--output", str(out), "--backend", backend], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return out


def bench_model(model: str, args, work: Path) -> list[dict]:
    """qic's images first, then the references' (the same settings; the thresholds from qic's probe), each side
    alone in memory: at --realwidth-depth 8 a side's fp32 weights are about 11 GB, two of them more than 24 GB."""
    ckpt, res = checkpoint(model, work, args.realwidth_depth)
    # The tiny model's bucket (and --smoke's back end) are the test suite's step-caching bundle's
    # (tests/test_step_cache.py): cache hits.
    bucket = 72 if model == "tiny" else 128
    out = build(ckpt, res, bucket, work / f"bundle-{model}", Path(args.cache_dir), args.backend)
    prompt = PROMPTS[model]
    ours = qic_side(out, prompt, res, args.steps)
    gc.collect()                       # the bundle's weights unmapped before the pipeline loads its own
    pipe = diffusers_pipe(ckpt)

    def timed(fn, *a, **kw):
        t = time.perf_counter()
        result = fn(*a, **kw)
        return result, time.perf_counter() - t

    pipe_call(pipe, prompt, 2, *res)   # warm-up, untimed: the pipeline's first call pays one-off costs
    rows = []
    for steps in args.steps:
        (base, base_s), cached = ours[steps]
        ref, ref_s = timed(pipe_call, pipe, prompt, steps, *res)
        rows.append({"model": model, "steps": steps, "setting": "uncached", "qic_s": base_s, "diffusers_s": ref_s,
                     "qic_stages": stages(base), "qic_computed": [steps, steps], "diffusers_computed": [steps, steps],
                     "qic_psnr": math.inf, "diffusers_psnr": math.inf, "qic_vs_diffusers_psnr": psnr(base.image, ref)})
        for thr, r, q_s in cached:
            mask = static_mask(steps)
            if thr is not None:
                setting = f"threshold {thr:g}"
                (img, computed), d_s = timed(fbc_reference, pipe, thr, prompt, steps, *res)
            else:
                setting = f"mask {len(mask)}/{steps}"
                lead = next(i for i in range(steps + 1) if i == steps or i not in mask)
                (img, computed), d_s = timed(dbcache_reference, pipe, steps, prompt, *res, Fn_compute_blocks=1,
                                             Bn_compute_blocks=0, max_warmup_steps=lead, residual_diff_threshold=0.08,
                                             steps_computation_mask=[int(i in mask) for i in range(steps)],
                                             steps_computation_policy="static")
            rows.append(side_by_side(model, steps, setting, r, q_s, img, computed, d_s, base, ref))
    depth = json.loads((ckpt / "transformer" / "config.json").read_text())["num_layers"]
    return [r | {"depth": depth} for r in rows]


def qic_side(out: Path, prompt: str, res, step_counts: list[int]) -> dict:
    """steps -> ((uncached Result, seconds), [(threshold or None for the mask, Result, seconds)]): the uncached
    image, a probe whose figures give three thresholds, an image at each, and one at the static mask (the bundle
    dropped on return)."""
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    bundle = Bundle(out)

    def qic_image(steps, **cache):
        t = time.perf_counter()
        r = generate(bundle, Request(prompt, steps=steps, guidance=GUIDANCE, seed=SEED, height=res[0], width=res[1],
                                     **cache))
        return r, time.perf_counter() - t

    # Warm-up, untimed: each graph's first call pays one-off costs.
    qic_image(2)
    qic_image(2, cache_threshold=1e-9)   # every step computes: head and rest
    qic_image(2, cache_steps="0")        # step 1 caches: head and tail
    runs = {}
    for steps in step_counts:
        base = qic_image(steps)
        probe, _ = qic_image(steps, cache_threshold=1e-9)   # figures only: nothing is that close
        cached = [(thr, *qic_image(steps, cache_threshold=thr)) for thr in thresholds_from(probe.figures)]
        cached.append((None, *qic_image(steps, cache_steps=",".join(map(str, static_mask(steps))))))
        runs[steps] = base, cached
    return runs


def row_key(r: dict) -> tuple:
    """A row's place: a run at another depth (--realwidth-depth) or step count adds rows, never replaces these."""
    return r["model"], r["depth"], r["steps"]


def stages(result) -> dict:
    """Where qic's image went (seconds): the text encoder, the decoder, all steps, and the median step that computed
    the middle blocks for some row (head + rest, or the whole-step graph uncached) and that cached it for every row
    (head + tail). The steps' share against the uncached image's is what caching can change; the rest it cannot."""
    t = result.timings
    steps = [t[f"step{i}"] for i in range(sum(k.startswith("step") for k in t))]
    computed = set().union(*result.computed) if result.computed else set(range(len(steps)))
    cached = [s for i, s in enumerate(steps) if i not in computed]
    return {"text": t.get("tokenize", 0.0) + t.get("encode", 0.0), "decode": t.get("decode", 0.0),
            "steps": sum(steps), "computed_step": statistics.median([s for i, s in enumerate(steps) if i in computed]),
            "cached_step": statistics.median(cached) if cached else None}


def side_by_side(model, steps, setting, result, qic_s, image, computed, diffusers_s, base, ref) -> dict:
    """One row: qic's cached run (a Result) and the reference's (image, computed steps per branch)."""
    return {"model": model, "steps": steps, "setting": setting, "qic_s": qic_s, "diffusers_s": diffusers_s,
            "qic_stages": stages(result), "qic_computed": [len(c) for c in result.computed],
            "diffusers_computed": [len(computed["cond"]), len(computed["uncond"])],
            "same_steps": result.computed == [computed["cond"], computed["uncond"]],
            "qic_psnr": psnr(result.image, base.image), "diffusers_psnr": psnr(image, ref),
            "qic_vs_diffusers_psnr": psnr(result.image, image)}


# ------------------------------------------------------------------------------------------ report

def _db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f}"


def table(rows: list[dict]) -> str:
    out = ["| model | blocks | steps | setting | qic s/image | diffusers s/image | qic / diffusers | "
           "steps computed qic (cond, uncond) | diffusers | same steps | PSNR qic (dB) | PSNR diffusers (dB) | "
           "qic vs diffusers (dB) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['depth']} | {r['steps']} | {r['setting']} | {r['qic_s']:.2f} | "
                   f"{r['diffusers_s']:.2f} | "
                   f"{r['qic_s'] / r['diffusers_s']:.2f}x | {r['qic_computed'][0]}, {r['qic_computed'][1]} | "
                   f"{r['diffusers_computed'][0]}, {r['diffusers_computed'][1]} | {r.get('same_steps', '-')} | "
                   f"{_db(r['qic_psnr'])} | {_db(r['diffusers_psnr'])} | {_db(r['qic_vs_diffusers_psnr'])} |")
    return "\n".join(out)


def stages_table(rows: list[dict]) -> str:
    """qic's rows split into what caching can change (the steps) and what it cannot (text encoder, decoder)."""
    out = ["| model | blocks | steps | setting | qic s/image | / uncached | text enc. s | decoder s | steps s | "
           "steps / uncached steps | computed step s | cached step s |",
           "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    base = {row_key(r): r for r in rows if r["setting"] == "uncached"}
    for r in rows:
        st, b = r.get("qic_stages"), base.get(row_key(r))
        if not st or not b or "qic_stages" not in b:
            continue   # rows from before the benchmark recorded stages
        cached = "-" if st["cached_step"] is None else f"{st['cached_step']:.3f}"
        out.append(f"| {r['model']} | {r['depth']} | {r['steps']} | {r['setting']} | {r['qic_s']:.2f} | "
                   f"{r['qic_s'] / b['qic_s']:.3f} | {st['text']:.2f} | {st['decode']:.2f} | {st['steps']:.2f} | "
                   f"{st['steps'] / b['qic_stages']['steps']:.3f} | {st['computed_step']:.3f} | {cached} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({row_key(r) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, depth, steps) in zip(axes[0], panels):
        sel = [r for r in rows if row_key(r) == (model, depth, steps)]
        cap = max([r[k] for r in sel for k in ("qic_psnr", "diffusers_psnr") if not math.isinf(r[k])] + [30]) + 5
        for side, marker in (("qic", "o"), ("diffusers", "s")):
            xs = [r[f"{side}_s"] for r in sel]
            ys = [min(r[f"{side}_psnr"], cap) for r in sel]
            ax.scatter(xs, ys, marker=marker, label=side)
            for r, x, y in zip(sel, xs, ys):
                ax.annotate(r["setting"].replace("threshold ", "t="), (x, y), fontsize=6)
        ax.set_title(f"{model} ({depth} blocks), {steps} steps", fontsize=9)
        ax.set_xlabel("seconds per image")
        ax.set_ylabel(f"PSNR vs uncached (dB; uncached drawn at {cap:.0f})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="shapes,realwidth")
    ap.add_argument("--steps", default="20,50")
    ap.add_argument("--realwidth-depth", type=int, default=2)
    ap.add_argument("--dir", default="artifacts/step-cache")
    ap.add_argument("--cache-dir", default="artifacts/cache")
    ap.add_argument("--img", default=str(REPO / "docs" / "img" / "step-cache.png"))
    ap.add_argument("--results", default=None, help="the figures' JSON (default: beside --img)")
    ap.add_argument("--plots-only", action="store_true")
    ap.add_argument("--backend", default="inductor", help="qic build's back end (--smoke: export, whose programs "
                    "torch runs: the smoke checks the run's steps, not compiled speed)")
    args = parse_args(ap, argv, {"models": "tiny", "steps": "3", "dir": None, "img": None, "backend": "export"})
    work = Path(args.dir) if args.dir else smoke_dir("step_cache")
    img = Path(args.img) if args.img else work / "img" / "step-cache.png"
    # The figures behind the plot sit beside it (committed), so a run of one model or step count replaces
    # only its own rows and the plot keeps the others; --smoke keeps its own in its temp dir.
    results = Path(args.results) if args.results else img.with_suffix(".json")
    rows = json.loads(results.read_text()) if results.exists() else []
    if not args.plots_only:
        args.steps = [int(s) for s in args.steps.split(",")]
        work.mkdir(parents=True, exist_ok=True)
        new = [r for m in args.models.split(",") for r in bench_model(m, args, work)]
        fresh = {row_key(r) for r in new}
        rows = [r for r in rows if row_key(r) not in fresh] + new
        rows.sort(key=lambda r: (r["model"] != "shapes", *row_key(r)))   # stable: settings keep order
        write_bytes_atomic(results, json.dumps(rows, indent=1).encode())
    print(table(rows))
    print(stages_table(rows))
    print(f"wrote {plot(rows, img)}")


if __name__ == "__main__":
    main(sys.argv[1:])
