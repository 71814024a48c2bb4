"""Qwen-Image-2.1's vision tower: Qwen3-VL's ViT, one condition image (one grid) per call.

What transformers' Qwen3VLVisionModel computes for an image of (grid_h, grid_w) patches: a Conv3d patch
embedding (a Linear over each flattened patch: kernel = stride = patch), plus a learned square table of position
embeddings resampled bilinearly (align_corners) to the grid, 2-D RoPE (height positions on the first half of each
head's rotary frequencies, width on the second), pre-LayerNorm blocks with full attention inside the image, then
the merger (LayerNorm, 2x2 patches concatenated, MLP) to one feature per merged token, and for each deepstack
index the block's output through its own merger (LayerNorm after the concatenation). Patches arrive in the image
processor's merge-block order (block row, block column, row in block, column in block), so every merge group is
4 consecutive patches; the positions are decoded from that order.

The grid is a Python-int argument: a graph per condition grid, its position tables computed in-graph from
arange (no buffers, no host sync). Replicated under TP (about 0.6B parameters at 2.1's sizes; the fused qkv's
layout would need a per-rank permutation to split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.models.common import VisionAttention, merge_block_rows_cols, vision_config, vision_rope

COMPONENT = "vision"


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
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @classmethod
    def from_dict(cls, d: Mapping) -> "VisionConfig":
        """vision_config of text_encoder/config.json (a Qwen3VLConfig), or that mapping itself."""
        v, get, rope = vision_config(d, COMPONENT, "gelu_pytorch_tanh")
        cfg = cls(
            depth=get("depth"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_heads=get("num_heads"), in_channels=get("in_channels", 3), patch_size=get("patch_size", 16),
            temporal_patch_size=get("temporal_patch_size", 2), spatial_merge_size=get("spatial_merge_size", 2),
            out_hidden_size=get("out_hidden_size"), num_position_embeddings=get("num_position_embeddings", 2304),
            deepstack_indexes=tuple(get("deepstack_visual_indexes", (8, 16, 24))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ConfigError(f"{COMPONENT} config: hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} "
                              "must be a whole head_dim divisible by 4 (2-D RoPE)")
        if cfg.grid_side ** 2 != cfg.num_position_embeddings:
            raise ConfigError(f"{COMPONENT} config sets vision_config.num_position_embeddings="
                              f"{cfg.num_position_embeddings}; qic needs a square table")
        if any(not 0 <= i < cfg.depth for i in cfg.deepstack_indexes):
            raise ConfigError(f"{COMPONENT} config sets vision_config.deepstack_visual_indexes="
                              f"{list(cfg.deepstack_indexes)}; each must be a block index below depth {cfg.depth}")
        return cfg


def vision_state_dict(names_to_tensors: Mapping) -> dict:
    """The vision tower's tensors of a full Qwen3-VL checkpoint mapping (model.visual.*; the hub's transformers
    4.57 and 5.x agree), names kept: they are the module's."""
    return {k: t for k, t in names_to_tensors.items() if k.startswith("model.visual.")}


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps [n, 2] into a side-long table and their weights for `index` on an axis of `size` (align_corners:
    the axis' ends map to the table's ends), in transformers' fp32 arithmetic."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = _MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """merge x merge consecutive patches -> one token. The final merger normalises each patch before the
    concatenation; the deepstack mergers normalise the concatenation (use_postshuffle_norm)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, x):
        # kernel = stride = one patch: the convolution is a Linear over the flattened patch
        return F.linear(x.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class _Visual(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embed = _PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(cfg, postshuffle=True) for _ in cfg.deepstack_indexes)


class _Model(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.visual = _Visual(cfg)


class QwenImage21Vision(nn.Module):
    """Qwen3-VL vision tower for one image. State-dict keys: the checkpoint's model.visual.*.

    forward(pixel_values [gh * gw, C * tp * p * p] in merge-block order (`patchify`), grid (gh, gw) as Python
    ints) -> (features [gh * gw / merge^2, out_hidden], deepstack [len(deepstack_indexes), same]): the text
    encoder's image_embeds and deepstack_embeds for this image; several images concatenate along dim 0 (dim 1
    of deepstack) in prompt order.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.model = _Model(config)

    def tables(self, gh: int, gw: int, device, dtype):
        """The grid's resampled position embeddings [n, hidden] and RoPE cos/sin [n, 1, head_dim] (fp32)."""
        cfg, m, side = self.config, self.config.spatial_merge_size, self.config.grid_side
        row, col = merge_block_rows_cols(torch.arange(gh * gw, device=device), gw, m)
        h_taps, h_w = _bilinear_taps(row, gh, side)
        w_taps, w_w = _bilinear_taps(col, gw, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wts = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        pos = (self.model.visual.pos_embed(idx) * wts[:, :, None]).sum(1).to(dtype)
        return (pos, *vision_rope(row, col, cfg.head_dim, cfg.rope_theta))

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]):
        cfg = self.config
        gh, gw = grid
        m = cfg.spatial_merge_size
        if gh % m or gw % m:
            raise ConfigError(f"{COMPONENT}: grid {gh}x{gw} is not a multiple of the merge size {m}")
        vis = self.model.visual
        x = vis.patch_embed(pixel_values)
        pos, cos, sin = self.tables(gh, gw, x.device, x.dtype)
        x = x + pos
        # Segments of blocks between deepstack taps, as slices, so the looped form (a StackedLayers, whose slices
        # are single callables over rows of its stacks) runs this same code. Taps in block order, each through the
        # merger of its place in the config's list, as transformers does.
        deepstack, start = [], 0
        for i in sorted(set(cfg.deepstack_indexes)):
            for block in vis.blocks[start:i + 1]:
                x = block(x, cos, sin)
            deepstack.append(vis.deepstack_merger_list[cfg.deepstack_indexes.index(i)](x))
            start = i + 1
        for block in vis.blocks[start:]:
            x = block(x, cos, sin)
        merged = vis.merger(x)
        return merged, torch.stack(deepstack) if deepstack else merged.new_zeros(0, *merged.shape)


BLOCK_PREFIX = "model.visual.blocks"


class LoopedQwenImage21Vision(QwenImage21Vision):
    """The same tower with its blocks stacked [depth, ...] and run by qic.models.looped.StackedLayers: one block
    body per segment between deepstack taps, whatever the depth (27 in 2.1). Same forward and outputs.
    Convert with qic.models.looped.stack_block_weights(sd, BLOCK_PREFIX, depth)."""

    def __init__(self, config: VisionConfig):
        from qic.models.looped import StackedLayers  # not at import: looped imports the Qwen-Image models
        one = dataclasses.replace(config, depth=1, deepstack_indexes=())
        super().__init__(dataclasses.replace(config, depth=0, deepstack_indexes=()))
        self.config = config
        vis = self.model.visual
        vis.deepstack_merger_list = nn.ModuleList(_Merger(config, postshuffle=True) for _ in config.deepstack_indexes)
        vis.blocks = StackedLayers(QwenImage21Vision(one).model.visual.blocks[0], config.depth, num_carry=1)
