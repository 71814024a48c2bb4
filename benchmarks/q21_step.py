"""Qwen-Image-2.1's denoise step at real widths: decode against prefill, text only and with one condition image,
qic's compiled graphs against diffusers' transformer with and without its KV cache, in one run.

    python -m benchmarks.q21_step [--depth 1] [--size 256] [--condition 256] [--text 100] [--runs 3]
    python -m benchmarks.q21_step --smoke   # tiny widths, 64x64, 1 run, traced without inductor's C++ (aot_eager)

The published transformer config (tests/fixtures/qwen-image-2.1-configs: 32 heads of 128, hidden 4096, SwiGLU x3)
cut to `--depth` blocks, random weights, fp32 on this CPU. diffusers' QwenImage21Transformer2DModel runs each step
the way QwenImage21Pipeline calls it: without a cache (the whole [text | conditions | target] sequence every step),
and with its prefix cache (`kv_cache_mode="extract"` on the first step, `"cached"` after). qic runs the graphs a
bundle holds for the same request (qic.models.qwen_image_21.graphs: `prefill` / `decode`, and with a condition the
`prefill-images` / `decode-images` forms at one condition's slot capacity), the module the build makes (looped over
stacked block weights), compiled by inductor with qic's options in-process (torch.compile: the kernels a bundle's
AOTInductor package holds; benchmarks.package_gap measures the package's own overhead). The prompt is `--text`
tokens of a bucket of `--bucket`. Prints the median seconds per step of each and the ratios; each qic prefill is
checked against diffusers' first step (rel-L2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import parse_args

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "fixtures" / "qwen-image-2.1-configs" / "transformer" / "config.json"
# --smoke: widths of tens (tests/qwen_image_21_checkpoint.py's transformer, written out: benchmarks import no tests)
TINY = dict(num_layers=1, attention_head_dim=16, num_attention_heads=6, in_channels=16, out_channels=16,
            context_in_dim=48, mlp_ratio=3, axes_dims_rope=[4, 6, 6])


def _config(tiny: bool, depth: int) -> dict:
    config = dict(TINY) if tiny else {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    return config | {"num_layers": depth, "causal_condition": True}


def _timed(fn, runs: int) -> float:
    fn()   # warm-up: first touches, allocator
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


class Case:
    """One request's inputs for both sides: `text` prompt rows (after the dropped system tokens), optionally one
    condition image of cond x cond pixels placed before the prompt (2.1's ti2i template), the target."""

    def __init__(self, config: dict, size: int, text: int, cond: int, bucket: int):
        from qic.models.qwen_image_21.host.sequence import IMAGE, SLOT_TOKENS, TEXT, JointSequence, prefix_sizes
        g = torch.Generator().manual_seed(0)
        self.grid = (size // 16, size // 16)
        self.cond_grid = (cond // 16, cond // 16) if cond else None
        self.slots = (self.cond_grid[0] * self.cond_grid[1] // SLOT_TOKENS) if cond else 0
        head = 4 if cond else 0   # the template's tokens before the image
        segments = ((TEXT, head), (IMAGE, *self.cond_grid), (TEXT, text - head)) if cond else ((TEXT, text),)
        self.seq = JointSequence(segments, self.grid)
        self.text_rows, self.cond_rows, self.prefix = prefix_sizes(bucket, self.slots)
        width, channels = config["context_in_dim"], config["in_channels"]
        self.text = torch.randn(1, text + self.slots, width, generator=g)   # the encoder's rows, slots included
        self.cond = torch.randn(1, SLOT_TOKENS * self.slots, channels, generator=g) if cond else None
        self.target = torch.randn(1, self.grid[0] * self.grid[1], channels, generator=g)
        self.slot_mask = torch.zeros(1, text + self.slots, dtype=torch.bool)
        if cond:
            self.slot_mask[0, head:head + self.slots] = True
        self.timestep = torch.tensor([0.7])


def diffusers_steps(model, case: Case, runs: int) -> tuple[dict, torch.Tensor]:
    """Median seconds of diffusers' step without a cache, its extract step and its cached step; and the first
    step's prediction of the target."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    shapes = [[*([(1, *case.cond_grid)] if case.cond is not None else []), (1, *case.grid)]]
    img_mask = torch.cat([case.slot_mask, torch.ones(1, case.target.shape[1] // 4, dtype=torch.bool)], 1)
    latents = torch.cat([case.cond, case.target], 1) if case.cond is not None else case.target

    def call(cache=None, mode=None):
        out = model(hidden_states=latents, encoder_hidden_states=case.text, timestep=case.timestep,
                    img_shapes=shapes, img_mask=img_mask, kv_cache=cache, kv_cache_mode=mode, return_dict=False)[0]
        return out[:, -case.target.shape[1]:]

    with torch.no_grad():
        first = call()
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        call(cache, "extract")
        seconds = {"full": _timed(call, runs), "extract": _timed(lambda: call(QwenImage21KVCache(
            len(model.transformer_blocks)), "extract"), runs), "cached": _timed(lambda: call(cache, "cached"), runs)}
    return seconds, first


def qic_steps(module, config, case: Case, bucket: int, runs: int, compiler: str = "inductor"
              ) -> tuple[dict, torch.Tensor, float]:
    """Median seconds of qic's compiled prefill and decode graphs for the case; the prefill's prediction; and the
    seconds the two compiles took. `compiler` "aot_eager" traces the same graphs without generating code (the
    smoke's: the four C++ compiles were most of its minute, and they are the bundles' own, compiled in tests)."""
    from qic.backends.inductor.build import compile_options
    from qic.models.qwen_image_21.graphs import DECODE, DECODE_IMAGES, PREFILL, PREFILL_IMAGES, denoiser_graph
    from qic.models.qwen_image_21.host.sequence import prefix_inputs, rope_tables
    index, block_ids, key_valid = prefix_inputs(case.seq, case.prefix, case.text_rows)
    cos, sin = rope_tables(config.axes_dims_rope, case.seq, case.prefix)
    text = torch.zeros(1, case.text_rows, case.text.shape[2])
    text[:, :case.text.shape[1]] = case.text
    parts = (PREFILL_IMAGES, DECODE_IMAGES) if case.cond is not None else (PREFILL, DECODE)
    h, w = case.grid[0] * 16, case.grid[1] * 16
    compiled, t0 = {}, time.perf_counter()
    with torch.no_grad():
        for part in parts:
            gdef = denoiser_graph(module, config, h, w, bucket, part, "float32", case.slots)
            torch._dynamo.reset()
            compiled[part] = (torch.compile(gdef.module.eval(), fullgraph=True, options=compile_options("cpu"))
                              if compiler == "inductor" else torch.compile(gdef.module.eval(), fullgraph=True,
                                                                           backend=compiler))
        cond = [] if case.cond is None else [case.cond]
        cond_rows = case.cond_rows
        if cond:
            cond = [torch.cat([case.cond, case.cond.new_zeros(1, cond_rows - case.cond.shape[1], case.cond.shape[2])],
                              1)]
        prefill_args = (text, *cond, case.target, case.timestep, index, block_ids, key_valid.long(), cos, sin)
        pred, k, v = compiled[parts[0]](*prefill_args)
        decode_args = (case.target, case.timestep, k, v, key_valid.long(), cos[case.prefix:], sin[case.prefix:])
        compiled[parts[1]](*decode_args)
        compile_s = time.perf_counter() - t0
        seconds = {"prefill": _timed(lambda: compiled[parts[0]](*prefill_args), runs),
                   "decode": _timed(lambda: compiled[parts[1]](*decode_args), runs)}
    return seconds, pred, compile_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.q21_step", description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--size", type=int, default=256, help="the target's side in pixels (multiple of 32)")
    ap.add_argument("--condition", type=int, default=256, help="the condition image's side in pixels")
    ap.add_argument("--text", type=int, default=100, help="prompt rows after the dropped system tokens")
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="widths of tens instead of the real ones")
    ap.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                    help="qic's side compiled by inductor (the figures) or only traced (aot_eager: the smoke's)")
    args = parse_args(ap, argv, {"size": 64, "condition": 64, "text": 20, "bucket": 32, "runs": 1, "tiny": True,
                                 "compiler": "aot_eager"})
    from diffusers import QwenImage21Transformer2DModel

    from qic.models.common import load_weights
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image_21.components import COMPONENTS
    from qic.models.qwen_image_21.denoiser import denoiser_state_dict
    raw = _config(args.tiny, args.depth)
    torch.manual_seed(0)
    ref = QwenImage21Transformer2DModel(**raw).eval()
    with torch.no_grad():
        for p in ref.parameters():   # the default init leaves the output projection zero: draw every weight
            p.normal_(0, 0.02)
    comp = COMPONENTS["denoiser"]
    config = comp.parse_config(raw)
    module = comp.make_module(config, looped=True).eval()
    load_weights(module, stack_block_weights(denoiser_state_dict(ref.state_dict()), "transformer_blocks",
                                             args.depth), "denoiser")
    width = "tiny" if args.tiny else f"real (hidden {config.inner_dim})"
    print(f"{width} width, depth {args.depth}, target {args.size}x{args.size}, prompt {args.text} rows of bucket "
          f"{args.bucket}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; medians of {args.runs}; "
          f"qic's graphs by {args.compiler}")
    print("| request | qic prefill | qic decode | decode / prefill | diffusers, no cache | diffusers extract | "
          "diffusers cached | qic decode / diffusers cached | qic prefill vs diffusers (rel-L2) | compile |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for label, cond in (("text", 0), (f"text + one {args.condition}x{args.condition} image", args.condition)):
        case = Case(raw, args.size, args.text, cond, args.bucket)
        ours, pred, compile_s = qic_steps(module, config, case, args.bucket, args.runs, args.compiler)
        theirs, first = diffusers_steps(ref, case, args.runs)
        err = float((pred - first).norm() / first.norm())
        print(f"| {label} | {ours['prefill']:.3f} s | {ours['decode']:.3f} s | {ours['decode'] / ours['prefill']:.2f}x"
              f" | {theirs['full']:.3f} s | {theirs['extract']:.3f} s | {theirs['cached']:.3f} s | "
              f"{ours['decode'] / theirs['cached']:.2f}x | {err:.1e} | {compile_s:.0f} s |")


if __name__ == "__main__":
    main()
