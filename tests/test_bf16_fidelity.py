"""bf16 fidelity: a bundle built with the text encoder and denoiser in bf16 (VAE fp32) lands no further
from diffusers' fp32 image than diffusers' own bf16 pipeline does; and the model code itself, run in
bf16 without a compiler's fusions (as eager mode and the XLA lowering run it), is as accurate per
forward as diffusers' bf16 transformer.

The checkpoint is the embedded tiny one with its matrices halved: the embedded weights are drawn large
on purpose (so every block changes the image), which makes a single bf16 forward ~40% off for
diffusers and qic alike and the comparison pure noise; halved, a bf16 forward is ~0.7% off, as in a
real model. Bounds: qic's mean error <= 1.05x diffusers', and above a floor that only bf16 arithmetic
reaches (an fp32 bundle, which a build that ignored `dtype` would make, lands below it). Both errors
are bf16 rounding noise of the same computation; the 5% covers rounding-order differences (one batched
CFG call instead of two, a compiled graph's fusions; measured: qic 0.8/255, diffusers 3.4/255 —
inductor keeps fused pointwise chains in fp32). The per-forward check guards the model code: with the
timestep frequencies rounded to bf16 (fixed) it was 0.115 against diffusers' 0.0077; inductor had fused
that rounding away, XLA would not.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.conftest import TINY_RES, diffusers_image, image_diff, pixels, qic
from tests.helpers import scaled_checkpoint

PROMPT, NEGATIVE, STEPS, SEED, GUIDANCE = "a red bicycle leaning on a wall", "blurry", 4, 2, 4.0


@pytest.fixture(scope="module")
def halved_ckpt(tiny_ckpt, tmp_path_factory):
    return scaled_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("halved") / "ckpt", 0.5)


def bf16_floor(reference) -> tuple[float, float]:
    """(floor, amplitude): the mean pixel error, in levels, below which an image cannot have been made in bf16.

    bf16 keeps 8 significant bits, so one rounding moves a value by up to 2^-8 of itself, 0.72 * 2^-9 on average; a
    bf16 pipeline rounds every activation, the text embeddings and each step's velocity, many times over. A pixel is
    127.5 * (1 + x): a single such rounding of the image itself would move it by about 127.5 * |x| * 2^-9 levels, and
    rounding to 0..255 keeps that mean (E|round(a + d) - round(a)| = |d| for a fractional part placed at random).
    Floor: half of that, so below even one rounding's worth (0.045 for the text-to-image check's image; qic bf16
    measured 0.76). An fp32 bundle differs from diffusers only in summation order (~1e-5 relative, ~1e-3 levels):
    built so (dtype ignored), that image measured mean 0.00, max 0."""
    amplitude = float(abs(pixels(reference) / 127.5 - 1).mean())
    return 0.5 * 127.5 * amplitude * 2**-9, amplitude


@pytest.mark.slow
def test_bf16_bundle_is_no_worse_than_diffusers_bf16(halved_ckpt, tmp_path, cache_dir):
    config = tmp_path / "bf16.yaml"
    config.write_text(json.dumps({"model": str(halved_ckpt), "dtype": {"text_encoder": "bfloat16",
                                                                        "denoiser": "bfloat16"},
                                  "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": [0],
                                  "output": str(tmp_path / "bundle"), "cache_dir": str(cache_dir)}))
    qic("build", config)
    out = tmp_path / "qic-bf16.png"
    qic("run", tmp_path / "bundle", "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", STEPS,
        "--seed", SEED, "--guidance", GUIDANCE, "--output", out)
    reference = diffusers_image(halved_ckpt, PROMPT, NEGATIVE, guidance=GUIDANCE, seed=SEED, steps=STEPS)

    from diffusers import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained(str(halved_ckpt), torch_dtype=torch.bfloat16)
    pipe.vae.to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE, num_inference_steps=STEPS,
                  height=TINY_RES[0], width=TINY_RES[1], generator=torch.Generator("cpu").manual_seed(SEED)).images[0]

    ours_max, ours_mean = image_diff(Image.open(out), reference)
    theirs_max, theirs_mean = image_diff(theirs, reference)
    print(f"vs diffusers fp32: qic bf16 max {ours_max:.0f} mean {ours_mean:.2f}; "
          f"diffusers bf16 max {theirs_max:.0f} mean {theirs_mean:.2f} (0..255)")
    floor, amplitude = bf16_floor(reference)
    print(f"bf16 floor {floor:.3f} (image mean |x| {amplitude:.3f})")
    assert floor < ours_mean <= 1.05 * theirs_mean
    # The measure can fail: another seed's image is far outside it.
    other = diffusers_image(halved_ckpt, PROMPT, NEGATIVE, guidance=GUIDANCE, seed=SEED + 1, steps=STEPS)
    assert image_diff(other, reference)[1] > 10 * theirs_mean


def test_bf16_denoiser_forward_is_as_accurate_as_diffusers(halved_ckpt):
    """One bf16 forward of qic's denoiser module (no compiler) vs diffusers' bf16 transformer, both against
    diffusers in fp32, at t = 1 (the first step, where the timestep embedding's angles are largest)."""
    from diffusers import QwenImageTransformer2DModel

    from qic.builder.eager import EagerModel
    from qic.models.qwen_image.mmdit import rope_tables
    from tests.helpers import rel_l2
    folder = str(halved_ckpt / "transformer")
    ref = QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ref16 = QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    ours = EagerModel(halved_ckpt, [TINY_RES], [0], dtype="bfloat16").modules["denoiser"]
    cfg, grid, n = ours.config, (3, 5), 7
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 15, cfg.in_channels, generator=gen)
    e = torch.randn(1, n, cfg.joint_attention_dim, generator=gen)
    t = torch.tensor([1.0])
    cos, sin = rope_tables(cfg, *grid, n)
    with torch.no_grad():
        want = ref(hidden_states=x, encoder_hidden_states=e, timestep=t, img_shapes=[[(1, *grid)]],
                   return_dict=False)[0]
        theirs = ref16(hidden_states=x.bfloat16(), encoder_hidden_states=e.bfloat16(), timestep=t.bfloat16(),
                       img_shapes=[[(1, *grid)]], return_dict=False)[0]
        mine = ours(x.bfloat16(), e.bfloat16(), None, t.bfloat16(), cos, sin)
    print(f"bf16 forward rel-L2 vs fp32: qic {rel_l2(mine.float(), want):.4f}, "
          f"diffusers {rel_l2(theirs.float(), want):.4f}")
    # Same arithmetic in the same dtype up to rounding order: a 10% margin on diffusers' own error.
    assert rel_l2(mine.float(), want) <= 1.1 * rel_l2(theirs.float(), want)
