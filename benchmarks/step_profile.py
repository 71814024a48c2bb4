"""Where a compiled denoise step's time goes at the real width: matmuls, attention, and the rest.

    python -m benchmarks.step_profile [--size 512] [--bucket 128] [--depth 1] [--runs 3]
    python -m benchmarks.step_profile --smoke   # the embedded tiny model's widths, 32x32, 1 run

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
Two variants of the same graph, timed in alternation: `before`, inductor's own configs, and `after`, with
qic's CPU pass (qic.backends.inductor.passes: addmm's bias add moved into the consumer's fused kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks import parse_args
from benchmarks.realwidth import CONFIGS, reduced_configs

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "mkl_linear",
          "aten::_mkl", "_linear_pointwise", "onednn")
ATTENTION = ("scaled_dot_product", "_flash_attention", "sdpa", "flash_attention")


def category(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    if "cpp_fused" in low or "kernel_cpp" in low or low.startswith("graph_"):
        return "fused"
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


def step_module(size: int, bucket: int, depth: int, tiny: bool = False):
    """(step graph module, inputs) at the real widths, or the embedded tiny model's (`tiny`)."""
    from qic.builder.jobs import make_graph
    from qic.models.qwen_image.components import COMPONENTS
    configs = tiny_configs(depth) if tiny else reduced_configs(CONFIGS, depth)
    parsed = {n: c.parse_config(configs[c.folder]) for n, c in COMPONENTS.items()}
    torch.manual_seed(0)
    module = COMPONENTS["denoiser"].make_module(parsed["denoiser"], tp_size=1).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    gdef = make_graph("denoiser", module, parsed, {"resolution": [size, size], "bucket": bucket}, "float32")
    inputs = [torch.randn_like(t) if t.is_floating_point() and t.dim() else t for _, t in gdef.inputs]
    # the realistic prompt lengths of the real-width benchmark: 33 (cond) and 20 (uncond) of the bucket, or at
    # exact length (bucket 0: packed CFG) the two branches' text at those lengths
    names = [n for n, _ in gdef.inputs]
    if "negative_embeds" in names:
        for name, n in (("text_embeds", 33), ("negative_embeds", 20)):
            t = inputs[names.index(name)]
            inputs[names.index(name)] = torch.randn(1, n, t.shape[2], dtype=t.dtype)
    else:
        text_mask = torch.zeros_like(dict(gdef.inputs)["text_mask"])
        text_mask[0, :33] = 1
        text_mask[1, :20] = 1
        inputs[names.index("text_mask")] = text_mask
    inputs[names.index("timestep")] = torch.tensor(500.0)
    return gdef.module.eval(), inputs


def profile(size: int, bucket: int, depth: int, runs: int, tiny: bool = False, both: bool = True) -> dict:
    """Both variants compiled from one module, timed in alternation (the machine's load drifts), then each
    profiled: `before` with inductor's configs alone, `after` with qic's CPU pass (qic.backends.inductor.build).
    both=False (--smoke) compiles `after` only and reports it in both columns: the path, one compile the cheaper
    (tests/test_inductor_passes.py checks what the pass changes)."""
    import torch._inductor.config as inductor_config

    from qic.backends.inductor.build import compile_options
    inductor_config.cpp.enable_kernel_profile = True   # each generated kernel becomes a profiler event
    module, inputs = step_module(size, bucket, depth, tiny)
    res = {"size": size, "bucket": bucket, "depth": depth, "tiny": tiny, "variants": {}}
    compiled = {}
    with torch.no_grad():
        eager = module(*inputs)
        for name, passes in (("before", False), ("after", True)) if both else (("after", True),):
            torch._dynamo.reset()
            fn = torch.compile(module, backend="inductor", fullgraph=True,
                               options=compile_options("cpu", passes=passes))
            t0 = time.perf_counter()
            out = fn(*inputs)
            compiled[name] = fn
            res["variants"][name] = {"compile_s": time.perf_counter() - t0, "walls": [],
                                     "rel_l2": float((out - eager).norm() / eager.norm()),
                                     "max_abs": float((out - eager).abs().max())}
        for _ in range(runs):
            for name, fn in compiled.items():
                res["variants"][name]["walls"].append(_timed(lambda: fn(*inputs)))
        for name, fn in compiled.items():
            res["variants"][name] |= _breakdown(fn, inputs, runs)
    for v in res["variants"].values():
        v["step_s"] = statistics.median(v["walls"])
    res["variants"].setdefault("before", res["variants"]["after"])
    return res


def _breakdown(fn, inputs, runs: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        for _ in range(runs):
            fn(*inputs)
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
    lines = [f"{width} width, depth {res['depth']}, {res['size']}x{res['size']}, text bucket {res['bucket']}, CFG "
             f"batch 2, fp32; 2048^3 fp32 matmul in the same run: {rate / 1e9:.1f} GFLOP/s",
             f"step, median of {len(b['walls'])} alternating runs: before {b['step_s']:.3f} s, after "
             f"{a['step_s']:.3f} s ({b['step_s'] / a['step_s']:.3f}x); vs eager rel-L2 {b['rel_l2']:.1e} / "
             f"{a['rel_l2']:.1e}, max-abs {b['max_abs']:.1e} / {a['max_abs']:.1e}", "",
             "| part | before: s / step | share | after: s / step | share | GFLOP | after: GFLOP/s | / matmul rate |",
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
    lines.append(f"\nwhole step / matmul rate: before {all_flops / b['step_s'] / rate:.0%}, after "
                 f"{all_flops / a['step_s'] / rate:.0%}")
    for name, v in (("before", b), ("after", a)):
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
    args = parse_args(ap, argv, {"size": 32, "depth": 1, "runs": 1, "tiny": True})
    rate = matmul_rate(args.smoke)
    res = profile(args.size, args.bucket, args.depth, args.runs, args.tiny, both=not args.smoke)
    print(report(res, (rate + matmul_rate(args.smoke)) / 2))   # the rate before and after, averaged: it drifts


if __name__ == "__main__":
    main()
