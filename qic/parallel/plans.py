"""Tensor-parallel plans: which weights split by output rows (column-parallel) or by input columns
(row-parallel). Everything unlisted is replicated. Megatron-style: Q/K/V and MLP up-projections split
by rows (heads / hidden units stay contiguous), output and down projections split by columns and are
reduced inside the graph (RowLinear) before their bias is added, so biases of row-parallel layers stay
whole on every rank. Projections whose small output every rank needs whole (the denoiser's per-block
modulation, its output-norm and text-input projections) split by rows and are all-gathered
(GatherLinear); the timestep embedder is a column/row pair; the text encoder's token embedding splits by
vocabulary rows (VocabEmbedding: masked lookup, then an all_reduce sum). What stays whole: norms,
row-parallel biases, and the thin img_in / proj_out (64 latent channels wide).

PADDED tensors split along a dim that need not divide by TP (a vocabulary: fine-tunes add tokens, e.g.
401 rows). As in Megatron and vLLM, every rank holds ceil(n / tp) rows and the surplus rows at the end
(the last rank's) are zeros; no token id reaches them, since ids are < n and the embedding masks ids
outside a rank's rows. Every other split tensor must divide (heads, MLP width: the model refuses).

RANK_TENSORS are per-rank tensors no checkpoint holds, which stage 1 writes into every rank's file at
TP > 1: a vocab-parallel embedding's first row index, so one compiled graph serves every rank.
"""

from __future__ import annotations

import json
import re

import torch

COLUMN, ROW = 0, 1  # the tensor dim that is split

PLANS: dict[str, list[tuple[str, int]]] = {
    "text_encoder": [
        (r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
        (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ROW),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", COLUMN),
        (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ROW),
        (r"model\.embed_tokens\.weight", COLUMN),
    ],
    "denoiser": [
        (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.(weight|bias)", COLUMN),
        (r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)\.weight", ROW),
        (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj\.(weight|bias)", COLUMN),
        (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.2\.weight", ROW),
        (r"transformer_blocks\.\d+\.(img|txt)_mod\.1\.(weight|bias)", COLUMN),
        (r"(norm_out\.linear|txt_in|time_text_embed\.timestep_embedder\.linear_1)\.(weight|bias)", COLUMN),
        (r"time_text_embed\.timestep_embedder\.linear_2\.weight", ROW),
    ],
    "vae_decoder": [],
}
# name -> (the split tensor, its split dim): the rank's first index along that dim, int64 [1].
RANK_TENSORS: dict[str, dict[str, tuple[str, int]]] = {
    "text_encoder": {"model.embed_tokens.vocab_start": ("model.embed_tokens.weight", COLUMN)},
    "denoiser": {},
    "vae_decoder": {},
}
PADDED: dict[str, tuple[str, ...]] = {
    "text_encoder": ("model.embed_tokens.weight",),
    "denoiser": (),
    "vae_decoder": (),
}
PLAN_VERSION = 2


def split_dim(component: str, name: str) -> int | None:
    for pattern, dim in PLANS[component]:
        if re.fullmatch(pattern, name):
            return dim
    return None


def rows_per_rank(n: int, tp: int) -> int:
    """A rank's share of a split dim of size n: n / tp, rounded up for a PADDED tensor that does not divide."""
    return -(-n // tp)


def rank_slice(component: str, name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """One rank's part of a tensor: a contiguous chunk along the plan's dim, or the whole tensor. A PADDED
    tensor's chunks all have rows_per_rank rows, zeros past the end of the tensor."""
    dim = split_dim(component, name)
    if tp == 1 or dim is None:
        return tensor
    if name not in PADDED[component]:
        return tensor.chunk(tp, dim=dim)[rank]
    n = tensor.shape[dim]
    rows = rows_per_rank(n, tp)
    start = min(rank * rows, n)
    part = tensor.narrow(dim, start, min(rows, n - start))
    if part.shape[dim] == rows:
        return part
    pad = list(part.shape)
    pad[dim] = rows - part.shape[dim]
    return torch.cat((part, part.new_zeros(pad)), dim=dim)


def rank_tensors(component: str, full_shapes: dict[str, tuple], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The per-rank tensors stage 1 adds to rank `rank`'s file (none at TP 1)."""
    if tp == 1:
        return {}
    return {name: torch.tensor([rank * rows_per_rank(full_shapes[of][dim], tp)], dtype=torch.long)
            for name, (of, dim) in RANK_TENSORS[component].items()}


def plan_text(component: str) -> str:
    """The plan as text, for cache keys: an edit to a table makes new shards."""
    # PADDED only where it has entries: the components without padding keep their shard keys (a real
    # denoiser's shards are tens of GB to redo for nothing).
    padded = [PADDED[component]] if PADDED.get(component) else []
    return json.dumps([PLAN_VERSION, PLANS[component], RANK_TENSORS[component], *padded])
