"""Qwen-Image's vision tower for the Edit models: Qwen2.5-VL's ViT (transformers' Qwen2_5_VisionTransformer-
PretrainedModel), one condition image (one static grid) per call.

What it computes for an image of (grid_h, grid_w) patches, arriving in the image processor's merge-block order
(block row, block column, row in block, column in block: every merge group is 4 consecutive patches):
- a patch embedding (a Conv3d whose kernel is its stride: a Linear over the flattened patch, no bias);
- window attention: the merge groups regrouped window by window (windows of window_size / merge / patch merge
  groups a side, row-major, the last row and column of windows ragged), each block attending within its window,
  except the fullatt_block_indexes blocks, which attend over the whole image; here as one key mask per kind over
  the regrouped sequence (transformers runs SDPA per window: the same sums);
- 2-D RoPE over the whole head: rows on the first quarter of the rotary frequencies, columns on the second, the
  half repeated (rotate-half pairing), in fp32;
- pre-RMSNorm blocks with a SwiGLU MLP (biases on), then the merger (RMSNorm per patch, 4 patches concatenated,
  Linear, exact GELU, Linear) and the merged tokens put back in raster order.

The grid is a Python-int argument: a graph per condition grid, the window order and masks computed from ints at
trace time (constants of the graph). Tensor names: the checkpoint's `visual.*` (transformers 4.x; 5.x stores
`model.visual.*`, renamed by vision_state_dict).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.models.common import VisionAttention, merge_block_rows_cols, vision_config, vision_rope

COMPONENT = "vision"
EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_units(self) -> int:
        """A window's side in merge groups."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_dict(cls, d: Mapping) -> "VisionConfig":
        """vision_config of text_encoder/config.json (a Qwen2_5_VLConfig), or that mapping itself."""
        v, get, rope = vision_config(d, COMPONENT, "silu")
        cfg = cls(
            depth=get("depth"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_heads=get("num_heads"), in_channels=get("in_channels", 3), patch_size=get("patch_size", 14),
            temporal_patch_size=get("temporal_patch_size", 2), spatial_merge_size=get("spatial_merge_size", 2),
            out_hidden_size=get("out_hidden_size"), window_size=get("window_size", 112),
            fullatt_block_indexes=tuple(get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ConfigError(f"{COMPONENT} config: hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} "
                              "must be a whole head_dim divisible by 4 (2-D RoPE)")
        if cfg.window_units < 1:
            raise ConfigError(f"{COMPONENT} config sets vision_config.window_size={cfg.window_size}, less than one "
                              f"merge group ({cfg.spatial_merge_size} x {cfg.patch_size} pixels)")
        return cfg


def vision_state_dict(names_to_tensors: Mapping) -> dict:
    """The vision tower's tensors of a full Qwen2.5-VL checkpoint mapping, named `visual.*` (transformers 4.x's
    names; 5.x's model.visual.* renamed). Values passed through untouched (they may be lazy handles)."""
    out = {}
    for name, tensor in names_to_tensors.items():
        if name.startswith("model.visual."):
            name = name[len("model."):]
        elif not name.startswith("visual."):
            continue
        out[name] = tensor
    return out


def window_order(grid_h: int, grid_w: int, merge: int, units: int) -> tuple[list[int], list[int]]:
    """(order, window): the merge groups of a grid_h x grid_w patch grid listed window by window (each window
    `units` groups a side, row-major over windows and within them), and each listed group's window number: what
    transformers' get_vision_window_index computes for one image, as Python ints."""
    rows, cols = grid_h // merge, grid_w // merge
    order, window = [], []
    for n, (wy, wx) in enumerate((wy, wx) for wy in range(math.ceil(rows / units))
                                 for wx in range(math.ceil(cols / units))):
        for y in range(wy * units, min((wy + 1) * units, rows)):
            for x in range(wx * units, min((wx + 1) * units, cols)):
                order.append(y * cols + x)
                window.append(n)
    return order, window


class _RMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm: normalised in fp32, cast back, then scaled."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(cfg.hidden_size), _RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = _MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = _RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, x):
        # kernel = stride = one patch: the convolution is a Linear over the flattened patch
        return F.linear(x.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class _Visual(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg)


class QwenImageVision(nn.Module):
    """Qwen2.5-VL vision tower for one image. State-dict keys: visual.* (vision_state_dict).

    forward(pixel_values [gh * gw, C * tp * p * p] in merge-block order (the processor's pixel_values), grid
    (gh, gw) as Python ints) -> features [gh * gw / merge^2, out_hidden] in raster order of the merged grid: the
    language model's image embeddings for this image; several images concatenate in prompt order.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.visual = _Visual(config)

    def tables(self, grid_h: int, grid_w: int, device):
        """For the window-ordered sequence: the patch permutation, RoPE cos/sin [n, 1, head_dim] (fp32), the
        window mask [n, n] (True = attend) and the merged tokens' way back to raster order."""
        cfg, m = self.config, self.config.spatial_merge_size
        order, window = window_order(grid_h, grid_w, m, cfg.window_units)
        unit = m * m
        groups = torch.tensor(order, device=device)
        patches = (groups[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
        cos, sin = vision_rope(*merge_block_rows_cols(patches, grid_w, m), cfg.head_dim, cfg.rope_theta)
        ids = torch.tensor(window, device=device).repeat_interleave(unit)
        mask = ids[:, None] == ids[None, :]
        back = torch.argsort(groups)
        return patches, cos, sin, mask, back

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int], tables: tuple | None = None) -> torch.Tensor:
        """tables: `tables(*grid)` made beforehand (a graph holds them as buffers: made from Python lists, they
        would be constants baked into its code); None: made here."""
        cfg = self.config
        gh, gw = grid
        m = cfg.spatial_merge_size
        if gh % m or gw % m:
            raise ConfigError(f"{COMPONENT}: grid {gh}x{gw} is not a multiple of the merge size {m}")
        vis = self.visual
        patches, cos, sin, window_mask, back = tables if tables is not None else self.tables(gh, gw,
                                                                                             pixel_values.device)
        x = vis.patch_embed(pixel_values)[patches]
        full = set(cfg.fullatt_block_indexes)
        for i, block in enumerate(vis.blocks):
            x = block(x, cos, sin, None if i in full else window_mask)
        return vis.merger(x)[back]
