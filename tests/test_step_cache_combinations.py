"""Issue 29: step caching where it meets the other build options: the no-CFG graph (guidance <= 1, as
Lightning runs) with exact-length text (bucket 0), and a merged LoRA. Each against diffusers' FirstBlockCache
on the same checkpoint (with the LoRA fused), as tests/test_step_cache.py checks the plain build.

Bounds as there: decisions exactly (the threshold sits clear of every step's figure: the figures are printed
and the margin asserted, since fp32 reordering moves a figure by ~1e-6 only), images within 2/255 with a mean
under 0.02 of a level. Layouts, CFG-parallel batches and `qic serve` under TP: tests/test_step_cache_layouts.py,
tests/test_compiled_layouts.py.
"""

from __future__ import annotations

import pytest

from benchmarks.step_cache import diffusers_pipe, fbc_reference
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
from tests.conftest import SHORT_PROMPT, TINY_RES, image_diff
from tests.helpers import MAX_PIXEL, MEAN_PIXEL
from tests.test_lora import SCALE, write_lora
from tests.test_lora import _factors as lora_factors

pytestmark = pytest.mark.slow   # builds and compiles step-cached bundles

STEPS = 10
MIN_MARGIN = 1e-4      # relative distance of every figure from the threshold: 100x what fp32 reordering moves one


def _build(ckpt, cache_dir, out, **extra) -> None:
    """In process, one resolution, FirstBlockCache's split."""
    from qic.builder.pipeline import build
    from qic.spec import load_spec
    build(load_spec(None, {"model": str(ckpt), "cache_dir": str(cache_dir), "output": str(out),
                           "resolutions": ["{}x{}".format(*TINY_RES)], "step_cache": {"first": 1, "last": 0},
                           **extra}))


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    return diffusers_pipe(tiny_ckpt)


def _check(bundle, pipe, threshold, guidance):
    result = generate(Bundle(bundle), Request(SHORT_PROMPT, steps=STEPS, seed=0, guidance=guidance,
                                              cache_threshold=threshold))
    ref, ref_computed = fbc_reference(pipe, threshold, SHORT_PROMPT, STEPS, *TINY_RES, guidance=guidance)
    figures = [f for row in result.figures for f in row if f is not None]
    print(f"computed {result.computed} | diffusers {ref_computed} | figures {[round(f, 4) for f in figures]}")
    assert min(abs(f - threshold) / threshold for f in figures) >= MIN_MARGIN, "a figure sits on the threshold"
    names = ["cond", "uncond"][:len(result.computed)]
    assert dict(zip(names, result.computed)) == {k: v for k, v in ref_computed.items() if v}
    assert any(1 < len(c) < STEPS for c in result.computed), "nothing cached, or everything"
    worst, mean = image_diff(result.image, ref)
    print(f"vs diffusers' FirstBlockCache: max {worst:.0f}/255, mean {mean:.4f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    # The bound can fail: the uncached image is another one.
    plain = generate(Bundle(bundle), Request(SHORT_PROMPT, steps=STEPS, seed=0, guidance=guidance))
    assert plain.computed is None and image_diff(plain.image, ref)[0] > 2


def test_no_cfg_graph_with_exact_length_text(pipe, tiny_ckpt, cache_dir, workdir):
    """Guidance 1 on a bundle of no-CFG graphs only, text at its exact length: one row a step, decided as
    diffusers decides its cond-only run. Built with the export back end (the decisions are the host program's):
    the compiled exact-length graph is bundle_exact's, the no-CFG graph test_nocfg.py's, the split graphs those of
    tests/test_compiled_layouts.py's TP 2 x CFG-parallel 2 bundle."""
    out = workdir / "bundle-fbc-nocfg-exact"
    _build(tiny_ckpt, cache_dir, out, cfg=[False], text_buckets=0, backend="export")
    _check(out, pipe, 1.2, guidance=1.0)


def test_merged_lora(pipe, tiny_ckpt, cache_dir, workdir):
    """A LoRA merged at build time (the split graphs take the merged weights as every graph does: graphs are
    weight-independent) against diffusers with the same LoRA fused. Built with the export back end, as
    tests/test_step_cache.py's bundle of this split: what is checked is the merged weights and the decisions."""
    lora = workdir / "fbc-lora.safetensors"
    write_lora("peft", lora_factors(tiny_ckpt), lora)
    out = workdir / "bundle-fbc-lora"
    _build(tiny_ckpt, cache_dir, out, text_buckets=72, loras=[f"{lora}:{SCALE}"], backend="export")
    pipe.load_lora_weights(str(lora), adapter_name="fbc")
    pipe.fuse_lora(lora_scale=SCALE)
    try:
        _check(out, pipe, 1.2, guidance=4.0)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
