"""Qwen-Image-2.1's vision tower (qic.models.qwen_image_21.vision) against transformers 5's Qwen3VLVisionModel,
and with the text encoder against the whole Qwen3VLForConditionalGeneration as QwenImage21Pipeline reads it.
fp32 on CPU, the small random config of tests/test_qwen_image_21_text_encoder.py (vision depth 1, 2 heads of 16,
patch 4, merge 2, a 4x4 position table, one deepstack feature at block 0), weights re-drawn with sensitize_.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qic.errors import ConfigError
from qic.host.image_tokens import mrope_positions
from qic.models.common import load_weights, patchify
from qic.models.qwen_image_21.text_encoder import QwenImage21TextEncoder, TextEncoder21Config
from qic.models.qwen_image_21.vision import QwenImage21Vision, VisionConfig, vision_state_dict
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_
from tests.test_qwen_image_21_text_encoder import (
    BOUND,
    BROKEN_MIN,
    DROP,
    FIXTURE,
    GRIDS,
    IMAGE_ID,
    _config_dict,
    _hf_config,
    _image_prompt,
    _padded,
    _pipeline_embeds,
    _pixels,
)

transformers = pytest.importorskip("transformers")

# fp32 reordering bound for the tower: sums at most the merger's width (4 x 32) long; per block about seven in
# sequence (norm, qkv, scores, weighting, proj, norm, fc1, fc2) plus patch embedding (96 long) and the merger's
# three. About 1e-5; a wrong layout or table moves the features by 1e-2 or more.
def _bound(depth: int) -> float:
    return fp32_reorder_bound(4 * 32, 8 * depth + 4)


VISION_BOUND = _bound(1)


@pytest.fixture(scope="module")
def ref():
    model = transformers.Qwen3VLForConditionalGeneration(_hf_config())
    model.set_attn_implementation("sdpa")
    return sensitize_(model.eval())


@pytest.fixture(scope="module")
def tower(ref):
    m = QwenImage21Vision(VisionConfig.from_dict(_config_dict()))
    load_weights(m, vision_state_dict(ref.state_dict()), "vision")
    return m.eval()


def _ours(tower, grids, pixels):
    feats, deep, start = [], [], 0
    for _, h, w in grids:
        f, d = tower(pixels[start:start + h * w], (h, w))
        feats.append(f)
        deep.append(d)
        start += h * w
    return torch.cat(feats), torch.cat(deep, dim=1)


@pytest.mark.parametrize("n_images", [1, 2])
@torch.no_grad()
def test_matches_transformers_vision_model(ref, tower, n_images):
    grids = GRIDS[:n_images]
    pixels = _pixels(grids)
    want = ref.model.visual(pixels, grid_thw=torch.tensor(grids))  # both images in one call, as the pipeline
    feats, deep = _ours(tower, grids, pixels)
    w_deep = torch.stack(want.deepstack_features)
    assert feats.shape == want.pooler_output.shape and deep.shape == w_deep.shape
    assert want.pooler_output.std() > 0.1 and w_deep.std() > 0.1
    err = max(rel_l2(feats, want.pooler_output), rel_l2(deep, w_deep))
    assert err <= VISION_BOUND, f"rel-L2 {err:.3g} > {VISION_BOUND:.3g}"
    print(f"\nvision, {n_images} image(s): rel-L2 {err:.3g} (bound {VISION_BOUND:.3g}), max-abs "
          f"{float((feats - want.pooler_output).abs().max()):.3g}")


@torch.no_grad()
def test_broken_variants_fail(ref, tower):
    grids = GRIDS[1:]  # 8x4: not square, so rows and columns can be told apart
    pixels = _pixels(grids)
    want = ref.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert rel_l2(_ours(tower, grids, pixels)[0], want) <= VISION_BOUND
    # the grid read transposed (positions and RoPE of a 4x8 image)
    assert rel_l2(tower(pixels, (4, 8))[0], want) > BROKEN_MIN
    # raster order instead of merge-block order for the position tables
    import qic.models.qwen_image_21.vision as V
    keep = V.merge_block_rows_cols
    try:
        V.merge_block_rows_cols = lambda k, gw, m: (k // gw, k % gw)
        assert rel_l2(tower(pixels, (8, 4))[0], want) > BROKEN_MIN
    finally:
        V.merge_block_rows_cols = keep
    # exact GELU in the blocks' MLP instead of the tanh approximation: a small change (measured 8.6e-5), which
    # the bound still tells apart
    for block in tower.model.visual.blocks:
        block.mlp.forward = lambda x, mlp=block.mlp: mlp.linear_fc2(torch.nn.functional.gelu(mlp.linear_fc1(x)))
    try:
        assert rel_l2(tower(pixels, (8, 4))[0], want) > 4 * VISION_BOUND
    finally:
        for block in tower.model.visual.blocks:
            del block.mlp.forward


def test_patchify_is_the_image_processors():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    cfg = VisionConfig.from_dict(_config_dict())
    image = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(0))
    want, gh, gw = Qwen2VLImageProcessorPil().patchify(image.numpy(), patch_size=4, merge_size=2,
                                                       temporal_patch_size=2)
    assert (gh, gw) == (8, 4)
    assert np.array_equal(patchify(image, cfg).numpy(), want)


@pytest.mark.parametrize("size", [(37, 53), (90, 20), (10, 12)])  # the last scaled up to min_pixels
def test_vision_pixels_are_the_image_processors(size):
    """Resize + normalise + patchify on the host gives the processor's pixel_values (and its grid: sampling's
    vision_grid); uint8 input, PIL's own bicubic, float32 arithmetic: equal within float32 rounding."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qic.host.condition_images import vision_grid
    from qic.host.vl_processor import QWEN3_VL, vision_pixels
    cfg = VisionConfig.from_dict(_config_dict())
    h, w = size
    rgb = np.random.default_rng(h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    mean, std = QWEN3_VL["image_mean"], QWEN3_VL["image_std"]
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=mean, image_std=std,
                                    size={"shortest_edge": 1024, "longest_edge": 4096})
    want = proc(images=[image], return_tensors="np")
    grid = vision_grid(h, w, patch_size=4, merge_size=2, min_pixels=1024, max_pixels=4096)
    assert [1, *grid] == want["image_grid_thw"][0].tolist()
    got = patchify(vision_pixels(image, grid, cfg.patch_size, mean, std), cfg).numpy()
    assert got.shape == want["pixel_values"].shape
    assert np.abs(got - want["pixel_values"]).max() <= 4e-7  # measured 1.2e-7: one float32 ulp at 1
    # the wrong normalisation (CLIP's, the processor class default) is far off
    clip = patchify(vision_pixels(image, grid, cfg.patch_size, (0.481, 0.458, 0.408), (0.269, 0.261, 0.276)), cfg)
    assert np.abs(clip.numpy() - want["pixel_values"]).max() > 0.05


@pytest.mark.parametrize("n_images", [1, 2])
@torch.no_grad()
def test_tower_and_text_encoder_match_the_pipeline_reading(ref, tower, n_images):
    """qic's tower feeding qic's text encoder against Qwen3VLForConditionalGeneration given the pixels."""
    grids = GRIDS[:n_images]
    te = QwenImage21TextEncoder(TextEncoder21Config.from_dict(_config_dict()), drop_tokens=DROP)
    from qic.models.qwen_image_21.text_encoder import text_encoder_state_dict
    load_weights(te, text_encoder_state_dict(ref.state_dict()), "text_encoder")
    r = _image_prompt(grids, 6, seed=5)
    ids, mask = _padded([r], len(r) + 4)
    pixels = _pixels(grids)
    feats, deep = _ours(tower, grids, pixels)
    got = te.eval()(ids, mask, mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 4), feats, deep)
    want = _pipeline_embeds(ref, r[None], torch.ones_like(r[None]), mm_token_type_ids=(r[None] == IMAGE_ID).int(),
                            pixel_values=pixels, image_grid_thw=torch.tensor(grids))[0]
    err = rel_l2(got[0, : len(want)], want)
    # the tower's reordering error passes through the language model: the two bounds add
    assert err <= BOUND + VISION_BOUND, f"rel-L2 {err:.3g}"
    print(f"\ntower + text encoder, {n_images} image(s): rel-L2 {err:.3g}, max-abs "
          f"{float((got[0, : len(want)] - want).abs().max()):.3g}")


def test_published_config_parses():
    cfg = VisionConfig.from_dict(json.loads(FIXTURE.read_text()))
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.patch_size) == (27, 1152, 16, 72, 16)
    assert (cfg.out_hidden_size, cfg.deepstack_indexes, cfg.grid_side) == (4096, (8, 16, 24), 48)
    d = _config_dict()
    d["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match="hidden_act"):
        VisionConfig.from_dict(d)
    d = _config_dict()
    d["vision_config"]["deepstack_visual_indexes"] = [1]
    with pytest.raises(ConfigError, match="deepstack_visual_indexes"):
        VisionConfig.from_dict(d)


@torch.no_grad()
def test_export_per_grid(tower):
    pixels = _pixels(GRIDS[:1])
    grid = GRIDS[0][1:]

    class PerGrid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = tower

        def forward(self, x):
            return self.tower(x, grid)

    ep = torch.export.export(PerGrid(), (pixels,))
    assert all(c.numel() == 1 for c in ep.constants.values())  # the tables are computed, not baked
    for a, b in zip(ep.module()(pixels * 0.5), tower(pixels * 0.5, grid)):
        assert rel_l2(a, b) <= VISION_BOUND


@torch.no_grad()
def test_looped_blocks_match_unrolled(ref):
    """Depth 3 with taps after blocks 0 and 2 listed out of order: segments [0], [1, 2], and none after."""
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image_21.vision import BLOCK_PREFIX, LoopedQwenImage21Vision
    d = _config_dict()
    d["vision_config"].update(depth=3, deepstack_visual_indexes=[2, 0])
    deep_ref = sensitize_(transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**d)).eval())
    cfg = VisionConfig.from_dict(d)
    unrolled = QwenImage21Vision(cfg)
    load_weights(unrolled, vision_state_dict(deep_ref.state_dict()), "vision")
    looped = LoopedQwenImage21Vision(cfg)
    load_weights(looped, stack_block_weights(unrolled.state_dict(), BLOCK_PREFIX, 3), "vision")
    grids = GRIDS[1:]
    pixels = _pixels(grids)
    want = deep_ref.model.visual(pixels, grid_thw=torch.tensor(grids))
    got = unrolled(pixels, grids[0][1:])
    assert rel_l2(got[0], want.pooler_output) <= _bound(3)
    assert rel_l2(got[1], torch.stack(want.deepstack_features)) <= _bound(3)  # taps in block order
    for a, b in zip(looped(pixels, grids[0][1:]), got):
        assert torch.equal(a, b)  # the same block code on slices of the stacks
