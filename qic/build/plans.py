"""Tensor-parallel plans: which weights split by output rows (column-parallel) or by input columns
(row-parallel). Everything unlisted is replicated. Megatron-style: Q/K/V and MLP up-projections split
by rows (heads / hidden units stay contiguous), output and down projections split by columns and are
reduced inside the graph (RowLinear) before their bias is added, so biases of row-parallel layers stay
whole on every rank."""

from __future__ import annotations

import re

import torch

COLUMN, ROW = 0, 1  # the tensor dim that is split

PLANS: dict[str, list[tuple[str, int]]] = {
    "text_encoder": [
        (r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
        (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ROW),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", COLUMN),
        (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ROW),
    ],
    "denoiser": [
        (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.(weight|bias)", COLUMN),
        (r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)\.weight", ROW),
        (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj\.(weight|bias)", COLUMN),
        (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.2\.weight", ROW),
    ],
    "vae_decoder": [],
}
PLAN_VERSION = 1


def split_dim(component: str, name: str) -> int | None:
    for pattern, dim in PLANS[component]:
        if re.fullmatch(pattern, name):
            return dim
    return None


def rank_slice(component: str, name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """One rank's part of a tensor: a contiguous chunk along the plan's dim, or the whole tensor."""
    dim = split_dim(component, name)
    if tp == 1 or dim is None:
        return tensor
    return tensor.chunk(tp, dim=dim)[rank]
