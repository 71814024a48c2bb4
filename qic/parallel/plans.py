"""Tensor-parallel plans applied: which weights split by output rows (column-parallel) or by input columns
(row-parallel), one rank's part of a tensor, the per-rank tensors stage 1 writes, and the plan's text for cache
keys. The tables are each component's own (qic.family.TPPlan, in its definition: Qwen-Image's and why they
split as they do are in qic/models/qwen_image/components.py); this module looks them up by component name and applies
them. Everything a table leaves unlisted is replicated.

A padded tensor splits along a dim that need not divide by TP (a vocabulary): as in Megatron and vLLM, every
rank holds ceil(n / tp) rows and the surplus rows at the end (the last rank's) are zeros; no token id reaches
them, since ids are < n and the embedding masks ids outside a rank's rows. Every other split tensor must divide.

Rank tensors are per-rank tensors no checkpoint holds, which stage 1 writes into every rank's file at TP > 1:
a vocab-parallel embedding's first row index, so one compiled graph serves every rank.
"""

from __future__ import annotations

import json
import re

import torch

from qic import family

PLAN_VERSION = 2


def plan_of(name: str):
    """A component's TP table (qic.family.TPPlan); an unknown component is one ConfigError line."""
    return family.component(name).tp_plan


def split_dim(component: str, name: str) -> int | None:
    for pattern, dim in plan_of(component).rules:
        if re.fullmatch(pattern, name):
            return dim
    return None


def rows_per_rank(n: int, tp: int) -> int:
    """A rank's share of a split dim of size n: n / tp, rounded up for a padded tensor that does not divide."""
    return -(-n // tp)


def rank_slice(component: str, name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """One rank's part of a tensor: a contiguous chunk along the plan's dim, or the whole tensor. A padded
    tensor's chunks all have rows_per_rank rows, zeros past the end of the tensor."""
    dim = split_dim(component, name)
    if tp == 1 or dim is None:
        return tensor
    if name not in plan_of(component).padded:
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
            for name, (of, dim) in plan_of(component).rank_tensors.items()}


def plan_text(component: str) -> str:
    """The plan as text, for cache keys: an edit to a table makes new shards."""
    # Padded tensors only where there are some: the components without padding keep their shard keys (a real
    # denoiser's shards are tens of GB to redo for nothing).
    plan = plan_of(component)
    padded = [plan.padded] if plan.padded else []
    return json.dumps([PLAN_VERSION, plan.rules, dict(plan.rank_tensors), *padded])
