"""Where a compiled denoise step's time goes at the real width: matmuls, attention, and the rest.

    python -m benchmarks.step_profile [--size 512] [--bucket 128] [--depth 1] [--runs 3]
    python -m benchmarks.step_profile --size 1024 --bucket 0 --depth 2 --against diffusers --dtype bfloat16
    python -m benchmarks.step_profile --smoke   # the embedded tiny model's widths, 32x32, 1 run, against diffusers

Builds the step graph qic compiles (qic.builder.jobs.make_graph: CFG batch 2, text padded to the
bucket, random weights of the real widths from tests/fixtures/qwen-image-configs, depth cut), compiles it
with inductor (the kernels AOTInductor emits for the same graph, run in-process so the profiler sees
them), and profiles `--runs` steps. Each profiler event's self time (its time less its children's) is
grouped into:
- matmul: the GEMMs (aten mm/addmm/bmm/linear, mkldnn/mkl packed kernels), with their FLOPs;
- attention: the SDPA kernel (flash attention for CPU, or its math fallback);
- fused: inductor's generated C++ kernels (layer norms, RMS norms, modulation, RoPE, GELU, residuals,
  CFG and the Euler update, and the copies between them);
- other: everything else (allocation, views, copies outside fused kernels).
Step time is the median wall time of the runs; the matmul rate is a 2048^3 fp32 matmul in the same run.
Two variants, timed in alternation: `before`, the same graph with inductor's own configs, and `after`, with
qic's CPU pass (qic.backends.inductor.passes: addmm's bias add moved into the consumer's fused kernel).
`--against diffusers` makes `before` diffusers' step instead, as benchmarks.per_image's "diffusers + compile" runs it:
QwenImageTransformer2DModel at the same widths and depth, its repeated block compiled
(`compile_repeated_blocks`), called for the cond and the uncond prompt at their own lengths (33 and 20 tokens, no
mask: diffusers drops an all-valid one), the norm-rescaled CFG combine and the Euler update (`--bucket 0`: qic's
packed-CFG graph of the same lengths). `--dtype bfloat16` runs both in bf16 (weights, activations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks import parse_args
from benchmarks.realwidth import CONFIGS, reduced_configs
from qic.dtypes import TORCH_DTYPES

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "mkl_linear",
          "aten::_mkl", "_linear_pointwise", "onednn")
ATTENTION = ("scaled_dot_product", "_flash_attention", "sdpa", "flash_attention")


def category(name: str) -> str:
    low = name.lower()
    # inductor's kernels first: a kernel is named after the ops its outputs feed, so the one that writes q, k, v
    # (QK norm, RoPE, the layout) is "cpp_fused__scaled_dot_product_flash_attention_..." but is no attention
    if "cpp_fused" in low or "kernel_cpp" in low or low.startswith("graph_"):
        return "fused"
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    return "other"


def matmul_rate(smoke: bool = False) -> float:
    """FLOP/s of a 2048^3 fp32 matmul: the same measure as the other benchmarks' (benchmarks.run; --smoke's smaller)."""
    from benchmarks.run import matmul_gflops
    return matmul_gflops(smoke) * 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def tiny_configs(depth: int) -> dict:
    """The embedded tiny preset's component configs (by folder) with `depth` transformer blocks: --smoke's."""
    from qic.checkpoint.presets import preset
    configs = preset("tiny")
    configs["transformer"]["num_layers"] = depth
    return configs


TEXT_LENGTHS = (33, 20)   # the cond and uncond prompts' tokens (benchmarks.realwidth's short prompt and " ")


def _configs(depth: int, tiny: bool) -> dict:
    return tiny_configs(depth) if tiny else reduced_configs(CONFIGS, depth)


def step_module(size: int, bucket: int, depth: int, tiny: bool = False, dtype: str = "float32"):
    """(step graph module, inputs) at the real widths, or the embedded tiny model's (`tiny`)."""
    from qic.builder.jobs import make_graph
    from qic.models.qwen_image.components import COMPONENTS
    configs = _configs(depth, tiny)
    parsed = {n: c.parse_config(configs[c.folder]) for n, c in COMPONENTS.items()}
    torch.manual_seed(0)
    module = COMPONENTS["denoiser"].make_module(parsed["denoiser"], tp_size=1).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    module.to(TORCH_DTYPES[dtype])
    gdef = make_graph("denoiser", module, parsed, {"resolution": [size, size], "bucket": bucket}, dtype)
    inputs = [torch.randn_like(t) if t.is_floating_point() and t.dim() else t for _, t in gdef.inputs]
    # the realistic prompt lengths of the real-width benchmark: 33 (cond) and 20 (uncond) of the bucket, or at
    # exact length (bucket 0: packed CFG) the two branches' text at those lengths
    names = [n for n, _ in gdef.inputs]
    if "negative_embeds" in names:
        for name, n in zip(("text_embeds", "negative_embeds"), TEXT_LENGTHS):
            t = inputs[names.index(name)]
            inputs[names.index(name)] = torch.randn(1, n, t.shape[2], dtype=t.dtype)
    else:
        text_mask = torch.zeros_like(dict(gdef.inputs)["text_mask"])
        for row, n in enumerate(TEXT_LENGTHS):
            text_mask[row, :n] = 1
        inputs[names.index("text_mask")] = text_mask
    inputs[names.index("timestep")] = torch.tensor(500.0)
    return gdef.module.eval(), inputs


def diffusers_step(size: int, depth: int, tiny: bool, dtype: str):
    """(diffusers' true-CFG step as a function of nothing, its model): QwenImagePipeline's loop body over
    QwenImageTransformer2DModel at the same widths and depth, random weights, the prompts at their own lengths."""
    from diffusers import QwenImageTransformer2DModel
    config = {k: v for k, v in _configs(depth, tiny)["transformer"].items() if not k.startswith("_")}
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    dt = TORCH_DTYPES[dtype]
    model.to(dt)
    side = size // 16      # latent pixels per token side: the VAE's 8 x the 2 x 2 patch
    latents = torch.randn(1, side * side, config["in_channels"], dtype=dt)
    texts = [torch.randn(1, n, config["joint_attention_dim"], dtype=dt) for n in TEXT_LENGTHS]
    timestep = torch.tensor([0.5], dtype=dt)

    def step():
        cond, neg = (model(hidden_states=latents, timestep=timestep, encoder_hidden_states=t,
                           img_shapes=[(1, side, side)], return_dict=False)[0] for t in texts)
        comb = neg + 4.0 * (cond - neg)
        pred = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        return latents + (0.4 - 0.5) * pred
    return step, model


def profile(size: int, bucket: int, depth: int, runs: int, tiny: bool = False, both: bool = True,
            against: str = "inductor", dtype: str = "float32") -> dict:
    """Both variants compiled, timed in alternation (the machine's load drifts), then each profiled: `after`
    qic's graph with qic's CPU pass (qic.backends.inductor.build), `before` the same graph with inductor's configs
    alone or (against="diffusers") diffusers' step with its repeated block compiled. both=False (--smoke)
    compiles `after` only and reports it in both columns: the path, one compile the cheaper
    (tests/test_inductor_passes.py checks what the pass changes)."""
    import torch._inductor.config as inductor_config

    from qic.backends.inductor.build import compile_options
    inductor_config.cpp.enable_kernel_profile = True   # each generated kernel becomes a profiler event
    module, inputs = step_module(size, bucket, depth, tiny, dtype)
    res = {"size": size, "bucket": bucket, "depth": depth, "tiny": tiny, "dtype": dtype, "against": against,
           "variants": {}}
    compiled = {}

    def qic_graph(passes: bool):
        if against != "diffusers":   # the same module compiled twice: the second compile must not reuse the first
            torch._dynamo.reset()
        m = torch.compile(module, backend="inductor", fullgraph=True, options=compile_options("cpu", passes=passes))
        return lambda: m(*inputs)

    def diffusers_compiled():
        model.compile_repeated_blocks(fullgraph=True)   # diffusers' regional compilation, as per_image's
        return step

    with torch.no_grad():
        # name: (the eager step, its compiled step once made)
        variants = {"after": (lambda: module(*inputs), lambda: qic_graph(True))}
        if against == "diffusers":
            step, model = diffusers_step(size, depth, tiny, dtype)
            variants["before"] = (step, diffusers_compiled)
        elif both:
            variants["before"] = (lambda: module(*inputs), lambda: qic_graph(False))
        for name, (eager_fn, make) in sorted(variants.items(), reverse=True):
            eager = eager_fn().float()
            fn = make()
            t0 = time.perf_counter()
            out = fn().float()
            compiled[name] = fn
            res["variants"][name] = {"compile_s": time.perf_counter() - t0, "walls": [],
                                     "rel_l2": float((out - eager).norm() / eager.norm()),
                                     "max_abs": float((out - eager).abs().max())}
        for _ in range(runs):
            for name, fn in compiled.items():
                res["variants"][name]["walls"].append(_timed(fn))
        for name, fn in compiled.items():
            res["variants"][name] |= _breakdown(fn, runs)
    for v in res["variants"].values():
        v["step_s"] = statistics.median(v["walls"])
    res["variants"].setdefault("before", res["variants"]["after"])
    return res


def _breakdown(fn, runs: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        for _ in range(runs):
            fn()
    totals: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in prof.events():   # self time: a parent's time minus its children's, so nothing counts twice
        cat = category(ev.name)
        totals[cat] += ev.self_cpu_time_total / 1e6 / runs
        flops[cat] += (ev.flops or 0) / runs
        if cat == "attention" and ev.name.startswith("aten::") and ev.input_shapes:
            # the profiler counts no FLOPs for SDPA: q @ k^T and p @ v, 2 * B * H * Lq * Lk * D each
            (b, h, lq, d), (_, _, lk, _) = ev.input_shapes[0], ev.input_shapes[1]
            flops[cat] += 4 * b * h * lq * lk * d / runs
        names[cat][ev.name] += ev.self_cpu_time_total / 1e6 / runs
    return {"seconds": dict(totals), "flops": dict(flops),
            "top": {c: sorted(v.items(), key=lambda kv: -kv[1])[:4] for c, v in names.items()}}


def report(res: dict, rate: float) -> str:
    b, a = res["variants"]["before"], res["variants"]["after"]
    width = "tiny" if res.get("tiny") else "real"
    bn, an = ("diffusers + compile", "qic") if res.get("against") == "diffusers" else ("before", "after")
    lines = [f"{width} width, depth {res['depth']}, {res['size']}x{res['size']}, text bucket {res['bucket']}, CFG "
             f"batch 2, {res.get('dtype', 'float32')}; 2048^3 fp32 matmul in the same run: {rate / 1e9:.1f} GFLOP/s",
             f"step, median of {len(b['walls'])} alternating runs: {bn} {b['step_s']:.3f} s, {an} "
             f"{a['step_s']:.3f} s ({b['step_s'] / a['step_s']:.3f}x); vs eager rel-L2 {b['rel_l2']:.1e} / "
             f"{a['rel_l2']:.1e}, max-abs {b['max_abs']:.1e} / {a['max_abs']:.1e}", "",
             f"| part | {bn}: s / step | share | {an}: s / step | share | GFLOP | {an}: GFLOP/s | / fp32 matmul rate |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    total_b, total_a = sum(b["seconds"].values()), sum(a["seconds"].values())
    for cat in ("matmul", "attention", "fused", "other"):
        sb, sa, f = b["seconds"].get(cat, 0.0), a["seconds"].get(cat, 0.0), a["flops"].get(cat, 0.0)
        speed = f"{f / sa / 1e9:.0f} | {f / sa / rate:.0%}" if f and sa else " | "
        lines.append(f"| {cat} | {sb:.3f} | {sb / total_b:.0%} | {sa:.3f} | {sa / total_a:.0%} | "
                     f"{f / 1e9:.0f} | {speed} |")
    all_flops = sum(a["flops"].values())
    lines.append(f"| step | {b['step_s']:.3f} | | {a['step_s']:.3f} | | {all_flops / 1e9:.0f} | "
                 f"{all_flops / a['step_s'] / 1e9:.0f} | {all_flops / a['step_s'] / rate:.0%} |")
    lines.append(f"\nwhole step / matmul rate: {bn} {all_flops / b['step_s'] / rate:.0%}, {an} "
                 f"{all_flops / a['step_s'] / rate:.0%}")
    for name, v in ((bn, b), (an, a)):
        for cat, top in v["top"].items():
            lines.append(f"{name} {cat}: " + "; ".join(f"{n[:48]} {s:.3f}" for n, s in top))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model's widths instead of the real ones")
    ap.add_argument("--against", choices=("inductor", "diffusers"), default="inductor",
                    help="before: the same graph without qic's pass (inductor) or diffusers' step (diffusers)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    # the smoke: the tiny widths, qic's graph against diffusers' step (the path with the most of its own code)
    args = parse_args(ap, argv, {"size": 32, "depth": 1, "runs": 1, "tiny": True, "against": "diffusers", "bucket": 0})
    if args.against == "diffusers" and args.bucket != 0:
        ap.error("--against diffusers compares the work diffusers does: qic's packed-CFG graph, --bucket 0 "
                 f"(--bucket {args.bucket} pads both branches' text to {args.bucket} rows)")
    rate = matmul_rate(args.smoke)
    res = profile(args.size, args.bucket, args.depth, args.runs, args.tiny, both=not args.smoke,
                  against=args.against, dtype=args.dtype)
    print(report(res, (rate + matmul_rate(args.smoke)) / 2))   # the rate before and after, averaged: it drifts


if __name__ == "__main__":
    main()
