"""Per image, against what a user would run instead: qic's bundle, diffusers eager, diffusers + regional compile.

    python -m benchmarks.per_image [--depth 2] [--resolutions 128,256,512,1024] [--steps 20] [--images 2]
    python -m benchmarks.per_image --table-only --dir DIR   # the table of an earlier run's DIR/results.json
    python -m benchmarks.per_image --resolutions 1024 --steps 5 --project-steps 20 \
        --sides qic,diffusers,diffusers-compile   # where 20 steps a side take hours: each image at 5 steps, per image
                                                  # at 20 reckoned from its measured stages (text + 20 x step + rest)
    python -m benchmarks.per_image --smoke   # --tiny, 48x80, 2 steps, the short prompt, 1 image; torch.compile's
                                             # "eager" back end

On a random checkpoint with the real Qwen-Image widths (benchmarks.realwidth's, depth reduced), per resolution,
dtype and prompt (a short one and a long one; --prompts), true CFG 4, in one run and one process tree, each side
in a process of its own (one at a time, so that they never share the two cores):
- qic: the bundle built here (a cold compile cache), loaded once; `--text-buckets` as given, else the build's
  default (exact-length text: a dynamic text dimension), and as a second row (qic-128) the same model built with
  one fixed text bucket of 128 (the default before exact length);
- diffusers: QwenImagePipeline eager;
- diffusers + compile: the same with `transformer.compile_repeated_blocks(fullgraph=True)` (diffusers' regional
  compilation of the repeated block, as its docs recommend); the first image of each prompt compiles, its excess
  over a steady image is reported as compile time and kept out of the per-image figure.
Each side draws one warm-up image per prompt, then `--images` timed ones: per image (median), per step (median),
and per stage: text encoder, the steps, the VAE decoder, and host work (the rest). The step's FLOPs each side
computes are counted on fake tensors: qic's graph at its text rows (padded to the bucket, or the prompt's own
length exact), diffusers' two calls at the prompts' own lengths. bf16 rows run where the CPU has bf16 units
(avx512_bf16 or amx_bf16 in /proc/cpuinfo; detected and printed). DIR/results.json is written after each
resolution, so a run stopped for time keeps the rows it finished. Figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import parse_args, realwidth, smoke_dir
from benchmarks.realwidth import GUIDANCE, SEED, label, resolution, step_flops

PROMPTS = {
    "short": "a red bicycle leaning against a blue wall",
    # Near the default bucket of 128 with the template (the benchmark checkpoint's embedded tokenizer splits finely).
    "long": ("a quiet harbour town at dawn seen from a hill above it: fishing boats with peeling blue and white "
             "paint moored along a stone quay, gulls over the water, a lighthouse on the breakwater"),
}
NEGATIVE = " "
# qic: the build's own text handling (exact-length text by default, or --text-buckets); qic-128: one fixed bucket of
# 128, the default before exact length (docs/benchmarks.md's run of 2026-12-06 called these qic-exact and qic).
SIDES = ("qic", "qic-128", "diffusers", "diffusers-compile")


def bf16_units() -> list[str]:
    """This CPU's bf16 instruction sets (empty: none), as qic's bf16 default reads them."""
    from qic.backends.inductor import BF16_UNITS
    from qic.backends.inductor.target import host_isa
    return sorted(BF16_UNITS & set(host_isa()))


# --------------------------------------------------------------------------------------------------- sides

def _timed(run_one, images: int, prompts: list[str]) -> dict:
    """Per prompt: one warm-up image, then `images` timed ones; each returns its stage seconds."""
    out = {}
    for name in prompts:
        prompt = PROMPTS[name]
        t = time.perf_counter()
        run_one(prompt)
        first = time.perf_counter() - t
        runs = []
        for _ in range(images):
            t = time.perf_counter()
            stages = run_one(prompt)
            runs.append({"total": time.perf_counter() - t, **stages})
        out[name] = {"first": first, "runs": runs}
    return out


def qic_side(bundle: str, size: str, steps: int, images: int, prompts: list[str]) -> dict:
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    from qic.runtime.heap import keep_freed_blocks
    keep_freed_blocks()   # as `qic run` does (this side's process is its own)
    model = Bundle(bundle)
    h, w = resolution(size)

    def one(prompt: str) -> dict:
        r = generate(model, Request(prompt=prompt, negative_prompt=NEGATIVE, steps=steps, guidance=GUIDANCE,
                                    seed=SEED, height=h, width=w))
        step = [v for k, v in r.timings.items() if k.startswith("step")]
        return {"text": r.timings["tokenize"] + r.timings["encode"], "steps": sum(step),
                "step": statistics.median(step), "decode": r.timings["decode"], "bucket": r.bucket}
    return _timed(one, images, prompts)


def diffusers_side(ckpt: str, size: str, steps: int, images: int, prompts: list[str], dtype: str,
                   compile_backend: str | None) -> dict:
    import torch
    from diffusers import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained(ckpt, torch_dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    if compile_backend:
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=compile_backend)
    h, w = resolution(size)
    spent: dict = {}

    def timed(owner, attr: str, stage: str) -> None:
        fn = getattr(owner, attr)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t
                spent.setdefault(stage + "_calls", []).append(time.perf_counter() - t)
        setattr(owner, attr, wrapper)
    timed(pipe, "encode_prompt", "text")
    timed(pipe.transformer, "forward", "steps")
    timed(pipe.vae, "decode", "decode")

    def one(prompt: str) -> dict:
        spent.clear()
        pipe(prompt, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE, num_inference_steps=steps, height=h,
             width=w, generator=torch.Generator("cpu").manual_seed(SEED))
        calls = spent["steps_calls"]   # cond, then uncond, per step
        return {"text": spent["text"], "steps": spent["steps"], "decode": spent["decode"],
                "step": statistics.median(a + b for a, b in zip(calls[0::2], calls[1::2]))}
    return _timed(one, images, prompts)


def run_side(args, side: str, size: str, dtype: str, where: Path) -> dict:
    """One side in a fresh process; its JSON result."""
    cmd = [sys.executable, "-m", "benchmarks.per_image", "--side", side, str(where), size, str(args.steps),
           str(args.images), ",".join(args.prompts), dtype, args.compile_backend]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{side} at {size} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("SIDE "))[len("SIDE "):])


def side_main(side: str, where: str, size: str, steps: str, images: str, prompts: str, dtype: str,
              backend: str) -> None:
    import torch
    torch.manual_seed(0)
    if side.startswith("qic"):
        res = qic_side(where, size, int(steps), int(images), prompts.split(","))
    else:
        res = diffusers_side(where, size, int(steps), int(images), prompts.split(","), dtype,
                             backend if side == "diffusers-compile" else None)
    print("SIDE " + json.dumps(res))


# ------------------------------------------------------------------------------------------------ the run

def build(args, ckpt: Path, dtype: str, buckets: str, out: Path) -> float:
    config = args.dir / f"build-{dtype}.yaml"
    config.write_text(json.dumps({"dtype": {"text_encoder": dtype, "denoiser": dtype, "vae_decoder": "float32"}}))
    cmd = [sys.executable, "-m", "qic.cli", "build", str(config), "--model", str(ckpt), "--output", str(out),
           "--cache-dir", str(args.cache_dir or args.dir / "cache"), *(["--text-buckets", buckets] if buckets else [])]
    for r in args.resolutions:
        cmd += ["--resolution", label(r)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def bench(args) -> dict:
    d: Path = args.dir
    d.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from qic.checkpoint.embedded import write_checkpoint
        from qic.checkpoint.presets import preset
        ckpt, configs = write_checkpoint(d / "ckpt-tiny", "tiny"), preset("tiny")
    else:
        ckpt, configs = realwidth.write_realwidth_checkpoint(d / f"ckpt-depth{args.depth}", args.depth), \
            realwidth.reduced_configs(realwidth.CONFIGS, args.depth)
    units = bf16_units()
    dtypes = ([] if args.bf16_only else ["float32"]) + (["bfloat16"] if units and not args.fp32_only else [])
    if not dtypes:
        raise SystemExit("--bf16-only: this CPU has no bf16 units (avx512_bf16, amx_bf16): no rows to run")
    res: dict = {"depth": configs["transformer"]["num_layers"], "steps": args.steps, "images": args.images,
                 "tiny": args.tiny, "bf16_units": units, "rows": []}
    lengths = {name: realwidth.templated_lengths(ckpt, [PROMPTS[name], NEGATIVE]) for name in args.prompts}
    for dtype in dtypes:
        bundles = {"qic": d / f"bundle-{dtype}", "qic-128": d / f"bundle-{dtype}-128"}
        buckets = {"qic": args.text_buckets, "qic-128": "128"}
        builds = {q: build(args, ckpt, dtype, buckets[q], bundles[q]) for q in bundles if q in args.sides}
        print(f"{dtype}: builds " + ", ".join(f"{q} {t:.0f} s" for q, t in builds.items()), flush=True)
        for r in args.resolutions:
            sides = {}
            for side in args.sides:
                sides[side] = run_side(args, side, r, dtype, bundles.get(side, ckpt))
                print(f"{dtype} {label(r)} {side}: " + ", ".join(
                    f"{p} {statistics.median(x['total'] for x in v['runs']):.2f} s" for p, v in sides[side].items()),
                    flush=True)
            h, w = resolution(r)
            for name, (n_cond, n_uncond) in lengths.items():
                bucket = sides[args.sides[0]][name]["runs"][0]["bucket"]   # 0: exact length, each row at its own
                flops = {q: step_flops(configs, h, w, sides[q][name]["runs"][0]["bucket"], lengths=(n_cond, n_uncond))
                         for q in ("qic", "qic-128") if q in sides}
                flops["diffusers"] = sum(step_flops(configs, h, w, n, cfg=False) for n in (n_cond, n_uncond))
                flops["diffusers-compile"] = flops["diffusers"]
                res["rows"].append({"dtype": dtype, "size": r, "prompt": name, "tokens": [n_cond, n_uncond],
                                    "bucket": bucket, "flops": flops, "build": builds,
                                    "sides": {s: v[name] for s, v in sides.items()}})
            (d / "results.json").write_text(json.dumps(res, indent=1))   # each resolution's rows as they finish
    return res


def table(res: dict, project: int | None = None) -> str:
    """The rows; with `project`, per image at that many steps: each image's text encoder, decoder and host work as
    measured, and `project` steps at its measured median step (the step's graph and inputs are the same each step)."""
    width = "tiny" if res["tiny"] else "real"
    per_image = (f"per image at {project} steps: measured text + decoder + host, {project} x the measured median "
                 f"step" if project else "per image")
    out = [f"{width} width, depth {res['depth']}, {res['steps']} steps, true CFG {GUIDANCE}, medians of "
           f"{res['images']} images after a warm-up image per prompt; bf16 units: "
           f"{', '.join(res['bf16_units']) or 'none (bf16 rows not run)'}; {per_image}", "",
           "| dtype | size | prompt (templated tokens cond/uncond) | side | per image | / best reference | per step "
           "| text enc. | steps | decoder | host | step GFLOP | compile |",
           "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in res["rows"]:
        med = {s: {k: statistics.median(x[k] for x in v["runs"]) for k in ("total", "text", "steps", "decode", "step")}
               for s, v in row["sides"].items()}
        for m in med.values():
            m["measured"] = m["total"]   # the compile column's baseline: an image at the steps run
            if project:
                m["total"] += project * m["step"] - m["steps"]
                m["steps"] = project * m["step"]
        best = min(med["diffusers"]["total"], med["diffusers-compile"]["total"])
        for side, m in med.items():
            first = row["sides"][side]["first"]
            # Compiling happens in the first image of the first prompt; a later prompt's first image is slower only
            # where its new text length recompiles (0 where it did not, or ran faster by chance).
            compile_s = (f"{max(0.0, first - m['measured']):.0f} s" if side == "diffusers-compile"
                         else f"{row['build'][side]:.0f} s build" if side in row["build"] else "")
            host = m["total"] - m["text"] - m["steps"] - m["decode"]   # unchanged by the projection
            out.append(f"| {row['dtype']} | {label(row['size'])} | {row['prompt']} ({row['tokens'][0]}/"
                       f"{row['tokens'][1]}) | {side} | {m['total']:.2f} s | {m['total'] / best:.2f}x | "
                       f"{m['step'] * 1e3:.0f} ms | {m['text']:.2f} s | {m['steps']:.2f} s | {m['decode']:.2f} s | "
                       f"{host:.2f} s | {row['flops'][side] / 1e9:.1f} | {compile_s} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.per_image", description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--resolutions", default="128,256,512,1024", help="sizes, comma-separated: N (NxN) or HxW")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--images", type=int, default=2, help="timed images per prompt and side (after a warm-up)")
    ap.add_argument("--text-buckets", default="", help="qic build's --text-buckets for the first qic row "
                                                       "(default: the build's own default)")
    ap.add_argument("--prompts", default="short,long", help=f"of {', '.join(PROMPTS)}")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile's back end for diffusers + compile")
    ap.add_argument("--fp32-only", action="store_true", help="no bf16 rows even where the CPU has bf16 units")
    ap.add_argument("--bf16-only", action="store_true", help="only the bf16 rows (where the CPU has bf16 units)")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint instead of the real widths")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/per-image"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache (default: DIR/cache)")
    ap.add_argument("--table-only", action="store_true", help="print the table of DIR/results.json (no run)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)} (both references always)")
    ap.add_argument("--project-steps", type=int, help="the table's per image at this many steps, from each image's "
                                                      "measured stages and median step (for runs at fewer --steps)")
    ap.add_argument("--side", nargs=8, help=argparse.SUPPRESS)
    # The smoke proves the path: the tiny model, and torch.compile's "eager" back end (dynamo traces the block, no
    # C++ compiles); its figures mean nothing.
    args = parse_args(ap, argv, {"tiny": True, "resolutions": "48x80", "steps": 2, "images": 1, "dir": None,
                                 "compile_backend": "eager", "fp32_only": True, "prompts": "short"})
    if args.side:
        return side_main(*args.side)
    args.dir = args.dir or smoke_dir("per_image")
    args.prompts = args.prompts.split(",")
    if not args.prompts or set(args.prompts) - set(PROMPTS):
        ap.error(f"--prompts: a comma-separated list of {', '.join(PROMPTS)}")
    args.sides = [s for s in SIDES if s in args.sides.split(",")]
    if not {"diffusers", "diffusers-compile"} <= set(args.sides) or not set(args.sides) & {"qic", "qic-128"}:
        ap.error(f"--sides: a comma-separated list of {', '.join(SIDES)} with both references and a qic side")
    args.resolutions = [f"{h}x{w}" if h != w else str(h) for h, w in map(resolution, args.resolutions.split(","))]
    print(table(json.loads((args.dir / "results.json").read_text()) if args.table_only else bench(args),
                args.project_steps))


if __name__ == "__main__":
    main()
