"""Pieces shared by the model files: config checking, strict weight loading, RMSNorm, the tensor-parallel
layers (RowLinear, GatherLinear, VocabEmbedding) whose collectives the TP plan sets from outside."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import CheckpointError, ConfigError
from qic.models.lora_slots import slot_term


def check_config_keys(config: Mapping, known: Iterable[str], component: str) -> None:
    """Refuse config keys qic does not know: a new variant flag must not be silently ignored.

    Keys starting with '_' are diffusers/transformers bookkeeping (_class_name, _diffusers_version).
    """
    unknown = sorted(k for k in config if not k.startswith("_") and k not in set(known))
    if unknown:
        raise ConfigError(
            f"{component} config has keys qic does not support: {', '.join(unknown)}",
            "this checkpoint is a model variant qic does not implement yet",
        )


def require_value(config: Mapping, key: str, allowed, component: str) -> None:
    """A flag that qic knows but implements only for some values (e.g. zero_cond_t=False)."""
    if key in config and config[key] not in allowed:
        raise ConfigError(
            f"{component} config sets {key}={config[key]!r}; qic supports only {sorted(map(repr, allowed))}"
        )


def vision_config(d: Mapping, component: str, hidden_act: str) -> tuple[Mapping, Callable, Mapping]:
    """A Qwen-VL vision tower's settings: (the mapping, a getter, its rope parameters) from text_encoder/config.json's
    vision_config (or that mapping itself), after the checks every Qwen-VL tower shares: its activation (the one the
    caller implements), axial RoPE, one int patch size each way. The getter names a missing key in one line."""
    v = d.get("vision_config", d)

    def get(key, default=None):
        value = v.get(key, default)
        if value is None:
            raise ConfigError(f"{component} config lacks vision_config.{key}")
        return value

    if get("hidden_act", hidden_act) != hidden_act:
        raise ConfigError(f"{component} config sets vision_config.hidden_act={v['hidden_act']!r}; "
                          f"qic implements only {hidden_act}")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"{component} config sets vision_config.rope_parameters.rope_type="
                          f"{rope['rope_type']!r}; qic implements only axial")
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v.get(key, 1), int):
            raise ConfigError(f"{component} config sets vision_config.{key}={v[key]!r}; qic needs one int")
    return v, get, rope


def load_weights(module: nn.Module, state_dict: Mapping[str, torch.Tensor], component: str,
                 assign: bool = False) -> None:
    """Load by the checkpoint's own tensor names; name every missing, unexpected or misshapen tensor."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_short(unexpected)}")
    for name in sorted(set(own) & set(state_dict)):
        if tuple(own[name].shape) != tuple(state_dict[name].shape):
            problems.append(
                f"tensor {name} has shape {tuple(state_dict[name].shape)}, expected {tuple(own[name].shape)}")
    if problems:
        raise CheckpointError(f"{component}: " + "; ".join(problems))
    module.load_state_dict(dict(state_dict), strict=True, assign=assign)


def _short(names: list[str], n: int = 6) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back; weight optional (diffusers' QK norms have one)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.to(dtype)


class Linear(nn.Linear):
    """nn.Linear that may carry a LoRA slot (qic.models.lora_slots: per-request adapters as graph inputs); without
    one it is exactly nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        extra = slot_term(self, x)
        return y if extra is None else y + extra


class RowLinear(nn.Linear):
    """A Linear whose input features may be split across tensor-parallel ranks.

    Under TP the partial products are summed (`reduce`, set by the TP plan) before the bias is added,
    so the bias counts once; a LoRA slot's partial product joins them before the sum. With `reduce` unset it is
    exactly nn.Linear. Tensor names are nn.Linear's.
    """

    reduce = None  # callable(tensor) -> tensor, e.g. a functional all_reduce; a class default keeps state_dict clean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        extra = slot_term(self, x)
        if extra is not None:
            y = y + extra
        if self.reduce is not None:
            y = self.reduce(y)
        return y if self.bias is None else y + self.bias


class GatherLinear(Linear):
    """A column-parallel Linear whose (small) output every rank needs whole: the modulation and output-norm
    projections, the text input projection.

    Each rank holds a contiguous chunk of the output features (and a LoRA slot's output rows); `gather` (set by
    the TP plan) all-gathers the chunks in rank order, which is the whole output in the original feature order.
    With `gather` unset it is exactly nn.Linear. Tensor names are nn.Linear's.
    """

    gather = None  # callable(tensor [..., n]) -> tensor [..., tp * n]; a class default keeps state_dict clean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.gather is None else self.gather(y)


class VocabEmbedding(nn.Module):
    """A token embedding whose vocabulary rows may be split across tensor-parallel ranks.

    tp_size 1: exactly F.embedding over the whole table (tensor name `weight`). tp_size N: `weight` holds
    vocab_size / N consecutive rows starting at `vocab_start` (a per-rank int64 [1] tensor that stage 1
    writes into each rank's weights, so one compiled graph serves every rank). Ids outside the rank's rows
    look up zeros, and `reduce` (the TP plan's all_reduce sum) adds the ranks' parts: exactly one rank
    contributes each token's row and the others add exact zeros, so the result equals TP=1 bit for bit.
    """

    reduce = None

    def __init__(self, vocab_size: int, dim: int, tp_size: int = 1):
        super().__init__()
        if vocab_size % tp_size:
            raise ConfigError(f"vocab_size={vocab_size} is not divisible by tp_size={tp_size}",
                              "use a TP that divides the vocabulary (the real Qwen-Image's 152064 divides by 2, 4, 8)")
        self.tp_size = tp_size
        # Uninitialised: weights are always loaded (an init costs time on the real 152064 x 3584 table).
        self.weight = nn.Parameter(torch.empty(vocab_size // tp_size, dim))
        if tp_size > 1:
            self.register_buffer("vocab_start", torch.zeros(1, dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = torch.nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        x = torch.where(inside[..., None], x, 0)
        return x if self.reduce is None else self.reduce(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; pairs (2i, 2i+1) as (re, im) rotated by angle i: the real form of diffusers' complex
    x * e^{i a} (cos/sin [S, D/2]), in fp32 like diffusers (Qwen-Image's and Qwen-Image-2.1's attention)."""
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([re * c - im * s, re * s + im * c], -1).flatten(-2).to(x.dtype)


def heads_first(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, S, H, D] tensors (tokens before heads, as the projections make them) as SDPA takes them, [B, H, S, D],
    each laid out contiguously rather than as the transposed view: CPU's flash-attention kernel reads a head's rows
    in blocks, and over the view (rows H * D apart) it took 1.22x the time in bf16 and 1.12x in fp32 at 4129 tokens,
    24 heads of 128, for the same result bit for bit (docs/benchmarks.md, "Step speed at real width"). In a compiled
    graph the kernel that makes q and k (RoPE) writes them in that layout; a v straight from a matmul is one copy."""
    return tuple(x.transpose(1, 2).contiguous() for x in xs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Qwen's RoPE pairing: dimension i with i + d/2 (split halves, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def image_slots(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int, features: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a Qwen-VL language model's image features go: (is_image [B, L] bool, slot [B, L]), the valid
    <|image_pad|> tokens (padding whose id happens to be one stays text) and the feature row each reads, slot k of
    a row reading row k (masked_scatter's order), clamped to `features` rows so that a prompt with more slots than
    features cannot index past the table on a device that does not check."""
    is_image = (input_ids == image_token_id) & (attention_mask != 0)
    slot = (torch.cumsum(is_image.long(), dim=1) - 1).clamp(0, features - 1)
    return is_image, slot


def merge_block_rows_cols(k: torch.Tensor, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in the patch grid of patch k of a Qwen-VL processor's merge-block order (block row, block column,
    row in block, column in block), for a grid grid_w patches wide."""
    blocks_w = grid_w // merge
    row = (k // (merge * merge * blocks_w)) * merge + (k // merge) % merge
    col = ((k // (merge * merge)) % blocks_w) * merge + k % merge
    return row, col


def vision_rope(row: torch.Tensor, col: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen-VL vision tower's 2-D RoPE for patches at (row, col): head_dim/4 frequencies over head_dim/2, rows
    then columns, the halves repeated (transformers' axial vision rotary). cos/sin [n, 1, head_dim] fp32."""
    spatial, device = head_dim // 2, row.device
    theta = torch.tensor(theta, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))
    angles = torch.cat((row.float()[:, None] * inv_freq, col.float()[:, None] * inv_freq), dim=-1)
    angles = torch.cat((angles, angles), dim=-1)[:, None]   # broadcast over heads
    return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """A Qwen-VL vision block's attention over one image's patches [n, hidden]: fused qkv, 2-D RoPE applied in fp32
    and cast back (transformers' apply_rotary_pos_emb_vision; cos/sin [n, 1, head_dim]), SDPA with an optional key
    mask (Qwen2.5-VL's windows), proj. Tensor names qkv.*, proj.*, as the checkpoints'."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x, cos, sin, mask=None):
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, self.head_dim).unbind(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = heads_first(q[None], k[None], v[None])   # [1, heads, n, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


def patchify(image: torch.Tensor, cfg) -> torch.Tensor:
    """A normalised image [C, H, W] (H, W multiples of patch * merge) -> the processor's pixel_values
    [grid_h * grid_w, C * temporal_patch * patch * patch]: merge-block order, the still image repeated over the
    temporal patch, as Qwen2VLImageProcessor.patchify lays it out for Qwen2.5-VL and Qwen3-VL alike (cfg: a vision
    config's patch_size, spatial_merge_size, temporal_patch_size). Reshapes only: graph-friendly."""
    c, h, w = image.shape
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], tp, p, p)
    return x.reshape(gh * gw, c * tp * p * p)
