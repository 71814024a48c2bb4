"""qic's Qwen2.5-VL vision tower (the Edit models' condition images) against transformers' own
Qwen2_5_VisionTransformerPretrainedModel on sensitive random weights, fp32 on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from qic.errors import ConfigError
from qic.models.common import load_weights
from qic.models.qwen_image.vision import QwenImageVision, VisionConfig, vision_state_dict, window_order
from tests.conftest import ROOT
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

# Tiny widths; windows of 2 merge groups a side (56 / 2 / 14), block 1 of 3 attending over the whole image.
TINY = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, in_channels=3, patch_size=14,
            temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24, window_size=56,
            fullatt_block_indexes=[1])
# (grid_h, grid_w) in patches: ragged windows both ways (merged 5 x 7), and whole windows (merged 4 x 2)
GRIDS = [(10, 14), (8, 4)]
PUBLISHED = ROOT / "tests" / "fixtures" / "qwen-image-configs" / "text_encoder" / "config.json"   # the public one


@pytest.fixture(scope="module")
def models():
    config = Qwen2_5_VLVisionConfig(**TINY)
    config._attn_implementation = "eager"   # transformers' per-window loop, the reference for the key mask
    torch.manual_seed(0)
    ref = sensitize_(Qwen2_5_VisionTransformerPretrainedModel(config)).eval()
    ours = QwenImageVision(VisionConfig.from_dict(TINY)).eval()
    load_weights(ours, vision_state_dict({f"model.visual.{k}": v for k, v in ref.state_dict().items()}), "vision")
    # fp32 reordering bound (tests/helpers.py): per block about seven reductions (norms, qkv, scores, weighting,
    # proj, MLP up and down), each at most the patch's 1176 inputs long; plus the embedding and the merger.
    bound = fp32_reorder_bound(3 * 2 * 14 * 14, 7 * TINY["depth"] + 4)
    return ref, ours, bound


def _pixels(grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1], 3 * 2 * 14 * 14, generator=g)


def _ref(ref, pixels, grid):
    with torch.no_grad():
        return ref(pixels, grid_thw=torch.tensor([[1, *grid]])).pooler_output


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_features_match_transformers(models, grid):
    ref, ours, bound = models
    pixels = _pixels(grid)
    want = _ref(ref, pixels, grid)
    with torch.no_grad():
        got = ours(pixels, grid)
    assert got.shape == want.shape == (grid[0] * grid[1] // 4, TINY["out_hidden_size"])
    assert want.std() > 0.1
    err = rel_l2(got, want)
    print(f"{grid}: rel-L2 {err:.1e} (bound {bound:.1e})")
    assert err <= bound


def test_the_check_fails_without_windows_in_window_order_or_with_rows_and_columns_swapped(models, monkeypatch):
    ref, ours, bound = models
    grid = GRIDS[0]
    pixels = _pixels(grid)
    want = _ref(ref, pixels, grid)
    tables = QwenImageVision.tables

    def broken(how):
        def patched(self, gh, gw, device):
            patches, cos, sin, mask, back = tables(self, gh, gw, device)
            if how == "no windows":
                mask = torch.ones_like(mask)
            elif how == "window order kept":
                back = torch.arange(back.shape[0])
            elif how == "rows and columns swapped":
                half = cos.shape[-1] // 4
                cos, sin = (torch.cat([t[..., half:2 * half], t[..., :half]] * 2, -1) for t in (cos, sin))
            return patches, cos, sin, mask, back
        return patched

    for how in ("no windows", "window order kept", "rows and columns swapped"):
        monkeypatch.setattr(QwenImageVision, "tables", broken(how))
        with torch.no_grad():
            err = rel_l2(ours(pixels, grid), want)
        print(f"{how}: rel-L2 {err:.1e}")
        assert err > 100 * bound, how
    monkeypatch.undo()


def test_window_order_is_transformers(models):
    from transformers.vision_utils import get_vision_window_index
    for grid in GRIDS + [(6, 6), (2, 18)]:
        order, window = window_order(*grid, 2, 2)
        index, cu = get_vision_window_index(torch.tensor([[1, *grid]]), 2, 56, 14)
        assert order == index.tolist()
        sizes = [window.count(n) * 4 for n in sorted(set(window))]
        assert [0, *torch.tensor(sizes).cumsum(0).tolist()] == cu.tolist()


def test_exports_whole(models):
    _, ours, _ = models
    grid = GRIDS[1]
    pixels = _pixels(grid, seed=1)

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = ours

        def forward(self, x):
            return self.tower(x, grid)

    program = torch.export.export(Graph(), (pixels,))
    with torch.no_grad():
        assert torch.equal(program.module()(pixels), ours(pixels, grid))


def test_published_config_and_refusals():
    cfg = VisionConfig.from_dict(json.loads(PUBLISHED.read_text()))
    assert (cfg.depth, cfg.hidden_size, cfg.head_dim, cfg.window_units) == (32, 1280, 80, 4)
    assert cfg.fullatt_block_indexes == (7, 15, 23, 31) and cfg.out_hidden_size == 3584
    with pytest.raises(ConfigError, match="hidden_act"):
        VisionConfig.from_dict({**TINY, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="window_size"):
        VisionConfig.from_dict({**TINY, "window_size": 14})
    with pytest.raises(ConfigError, match="depth"):
        VisionConfig.from_dict({k: v for k, v in TINY.items() if k != "depth"})
    assert math.isclose(VisionConfig.from_dict(TINY).rope_theta, 10000.0)


def test_state_dict_names_both_layouts():
    t = torch.zeros(1)
    old = vision_state_dict({"visual.blocks.0.attn.qkv.weight": t, "model.layers.0.mlp.up_proj.weight": t,
                             "lm_head.weight": t})
    new = vision_state_dict({"model.visual.blocks.0.attn.qkv.weight": t,
                             "model.language_model.layers.0.mlp.up_proj.weight": t})
    assert list(old) == list(new) == ["visual.blocks.0.attn.qkv.weight"]
