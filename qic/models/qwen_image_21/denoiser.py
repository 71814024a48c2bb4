"""Qwen-Image-2.1's denoiser: diffusers' QwenImage21Transformer2DModel as a prefill and a cached decode.

A single-stream DiT: text and condition-image tokens (the prefix) and the target image's tokens share every
block; one shared `modulation` projection (of the timestep embedding) gives every block its scales and gates;
attention is block-causal ((q >= kv) or the same image block; text strictly causal). With causal_condition
the prefix is modulated at t = 0, so its keys and values are the same at every step. Hence two entry points
over one set of weights, like an LLM's:

- `prefill(...)`: the whole [prefix | target] sequence; returns the target's prediction and the prefix's
  per-layer keys and values, stacked [layers, B, heads, P, head_dim] (after QK-norm and RoPE, diffusers' cache
  form), a graph output that stays on the device;
- `decode(...)`: the target's tokens only, each layer attending to [that layer's prefix K/V | its own K/V].

Prefix tokens never attend to the target (it comes after them and is another block) and target tokens attend
to every real key, so each block runs the prefix first and the target after it against the prefix's K/V:
exactly diffusers' block-causal attention, without a [P + N]^2 mask. The decode is that target half alone, so
a prefill followed by decodes is the arithmetic of diffusers' "extract" then "cached" steps, and a prefill at
every step is its use_kv_cache=False.

Same tensor names as diffusers (its state_dict loads with strict=True, no renaming); compile-friendly: real
RoPE tables and the per-request sequence tensors are inputs (qic.models.qwen_image_21.host.sequence), no complex
numbers, no host syncs, every shape static per graph. TP by the model's own `_tp_plan` (TP_PLAN below): each
rank holds heads / tp attention heads and mlp_dim / tp SwiGLU columns; to_out and img_mlp.out are RowLinears
whose `reduce` the TP plan sets; the shared modulation, the embeddings, norm_out and proj_out are replicated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.family import COLUMN, ROW, TPPlan
from qic.models.common import RMSNorm, RowLinear, apply_rope, check_config_keys, heads_first, require_value

COMPONENT = "transformer"
TIME_PROJ_DIM = 256      # diffusers' QwenImage21TimestepProjEmbeddings: a fixed 256-wide sinusoid
# diffusers' __init__ signature defaults: what it fills in for a key a config.json leaves out.
DEFAULTS = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
                causal_condition=True)

# The model's own `_tp_plan`, as qic's table: (tensor-name regex, split dim); unlisted tensors are replicated.
TP_PLAN = TPPlan(rules=(
    (r"transformer_blocks\.\d+\.attn\.to_[qkv]\.weight", COLUMN),
    (r"transformer_blocks\.\d+\.attn\.to_out\.0\.weight", ROW),
    (r"transformer_blocks\.\d+\.img_mlp\.(proj|gate_layer)\.weight", COLUMN),
    (r"transformer_blocks\.\d+\.img_mlp\.out\.weight", ROW),
))


@dataclass(frozen=True)
class DenoiserConfig:
    patch_size: int
    in_channels: int
    out_channels: int
    num_layers: int
    attention_head_dim: int
    num_attention_heads: int
    context_in_dim: int
    mlp_ratio: int
    axes_dims_rope: tuple[int, int, int]
    eps: float

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.inner_dim

    @property
    def in_features(self) -> int:
        return self.in_channels * self.patch_size ** 2

    @property
    def out_features(self) -> int:
        return self.out_channels * self.patch_size ** 2

    @classmethod
    def from_dict(cls, d: Mapping) -> DenoiserConfig:
        """Parse transformer/config.json. causal_condition must be true: the prefix K/V cache (and so the two
        graphs) is only the same arithmetic when text and condition tokens are modulated at t = 0."""
        check_config_keys(d, DEFAULTS, COMPONENT)
        require_value(d, "causal_condition", (True,), COMPONENT)
        v = {**DEFAULTS, **{k: d[k] for k in DEFAULTS if k in d}}
        axes = tuple(int(a) for a in v["axes_dims_rope"])
        cfg = cls(int(v["patch_size"]), int(v["in_channels"]), int(v["out_channels"] or v["in_channels"]),
                  int(v["num_layers"]), int(v["attention_head_dim"]), int(v["num_attention_heads"]),
                  int(v["context_in_dim"]), int(v["mlp_ratio"]), axes, float(v["eps"]))
        if len(axes) != 3 or any(a % 2 for a in axes) or sum(axes) != cfg.attention_head_dim:
            raise ConfigError(f"{COMPONENT} config axes_dims_rope={list(axes)} must be three even sizes summing to "
                              f"attention_head_dim={cfg.attention_head_dim}")
        return cfg


# ------------------------------------------------------------------------------- attention masks (in the graph)

def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Additive, with the dtype's lowest finite value rather than -inf: a masked key's weight is exp(-huge) = 0
    # exactly whenever its row has a real key (every real token's row does), and a row with none (a padding
    # query) averages instead of turning into NaN, which would reach real tokens through 0 * NaN in P @ V.
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


def prefix_attention_bias(block_ids: torch.Tensor, key_valid: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[B, 1, P, P] additive bias of the prefix's queries over the prefix's keys: diffusers' block-causal rule,
    (q >= kv) or (the same image block, ids >= 0), and only keys key_valid [B, P] marks real. block_ids [P]:
    -1 for text and padding, an image's number for its tokens (qic.models.qwen_image_21.host.sequence.prefix_inputs)."""
    pos = torch.arange(block_ids.shape[0], device=block_ids.device)
    same_image = (block_ids[:, None] == block_ids[None, :]) & (block_ids[:, None] >= 0)
    allowed = (pos[:, None] >= pos[None, :]) | same_image
    return _bias(allowed[None, None] & key_valid[:, None, None, :], dtype)


def target_attention_bias(key_valid: torch.Tensor, target_len: int, dtype=torch.float32) -> torch.Tensor:
    """[B, 1, 1, P + N]: the target's queries see every real prefix key and all of their own block."""
    own = torch.ones(key_valid.shape[0], target_len, dtype=torch.bool, device=key_valid.device)
    return _bias(torch.cat([key_valid, own], 1)[:, None, None, :], dtype)


# ------------------------------------------------------------------------------- layers (diffusers' names)

def timestep_proj(t: torch.Tensor) -> torch.Tensor:
    """diffusers' QwenImage21TemporalTimesteps(256): [cos | sin] of (1000 t) f_k, in fp32 whatever the model
    dtype (bf16 angles would be off by radians at t = 1), the product in diffusers' order."""
    half = TIME_PROJ_DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_PROJ_DIM, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)


class ZeroCenterRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight is scale - 1 (diffusers' QwenImage21ZeroCenterRMSNorm), in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    def __init__(self, context_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = ZeroCenterRMSNorm(context_dim, eps)
        self.in_layer = nn.Linear(context_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class SwiGLU(nn.Module):
    """out(silu(gate_layer(x)) * proj(x)): proj and gate_layer column-parallel, out row-parallel."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)
        self.out = RowLinear(hidden, dim, bias=False)

    def forward(self, x):
        return self.out(F.silu(self.gate_layer(x)) * self.proj(x))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.head_dim = head_dim
        local = heads * head_dim  # heads is already this rank's count
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, local, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([RowLinear(local, dim, bias=False)])  # to_out.1 is diffusers' dropout
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def qkv(self, x, cos, sin):
        """q, k, v [B, H, S, D]: QK-RMSNorm and RoPE applied, so k and v are what a later step reuses."""
        def heads(y):
            return y.unflatten(-1, (-1, self.head_dim))

        q = apply_rope(self.norm_q(heads(self.to_q(x))), cos, sin)
        k = apply_rope(self.norm_k(heads(self.to_k(x))), cos, sin)
        return heads_first(q, k, heads(self.to_v(x)))

    def attend(self, q, k, v, bias):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """One single-stream block; no weights of its own for modulation (the model's shared one feeds it)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.attn = Attention(dim, heads, head_dim, eps)
        self.img_mlp = SwiGLU(dim, mlp_hidden)
        self.dim, self.eps = dim, eps

    def _ln(self, x):
        return F.layer_norm(x, (self.dim,), eps=self.eps)

    def forward(self, x, mod, cos, sin, bias, past=None):
        """x [B, S, dim], all modulated by mod [B or 1, 4 * dim] = (scale1, gate1, scale2, gate2). past: the
        (k, v) [B, H, P, D] these tokens also attend to, before their own (the prefix, for the target).
        Returns (x, k, v) with k, v these tokens' own [B, H, S, D]."""
        scale1, gate1, scale2, gate2 = mod[:, None].chunk(4, -1)
        q, k, v = self.attn.qkv(self._ln(x) * (1 + scale1), cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        x = x + gate1.tanh() * self.attn.attend(q, keys, values, bias)
        x = x + gate2.tanh() * self.img_mlp(self._ln(x) * (1 + scale2))
        if x.dtype == torch.float16:  # diffusers clips fp16 to avoid inf; a static dtype branch
            x = x.clip(-65504, 65504)
        return x, k, v


def prefill_layer(block, prefix, x, mod0, mod, rope_cos, rope_sin, prefix_bias, target_bias):
    """One block of the prefill: the prefix (at t = 0, block-causal), then the target against its K/V.
    Returns (prefix, x, k, v) with k, v the prefix's [B, H, P, D] at this block. The RoPE tables are sliced
    here, not by the caller: a scan refuses loop invariants that alias (two views of one table)."""
    n = prefix.shape[1]
    prefix, k, v = block(prefix, mod0, rope_cos[:n], rope_sin[:n], prefix_bias)
    x, _, _ = block(x, mod, rope_cos[n:], rope_sin[n:], target_bias, past=(k, v))
    return prefix, x, k, v


def decode_layer(block, x, k, v, mod, cos, sin, bias):
    """One block of a decode: the target against this block's cached prefix k, v [B, H, P, D]."""
    return block(x, mod, cos, sin, bias, past=(k, v))[0]


class NormOut(nn.Module):
    """diffusers' QwenImage21AdaLayerNormContinuous: scale only, no shift."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False)
        self.dim, self.eps = dim, eps

    def forward(self, x, temb):
        scale = self.linear(F.silu(temb).to(x.dtype))
        return F.layer_norm(x, (self.dim,), eps=self.eps) * (1 + scale[:, None])


class QwenImage21Denoiser(nn.Module):
    """The denoiser; state_dict keys are diffusers' tensor names. tp_size > 1: this rank's part (TP_PLAN)."""

    def __init__(self, config: DenoiserConfig, tp_size: int = 1):
        super().__init__()
        c = config
        if c.num_attention_heads % tp_size or c.mlp_dim % tp_size:
            raise ConfigError(f"{COMPONENT}: tp_size {tp_size} does not divide {c.num_attention_heads} attention "
                              f"heads and {c.mlp_dim} SwiGLU columns")
        self.config, self.tp_size = c, tp_size
        dim = c.inner_dim
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_in = TextProjection(c.context_in_dim, dim, c.eps)
        self.img_in = nn.Linear(c.in_features, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            Block(dim, c.num_attention_heads // tp_size, c.attention_head_dim, c.mlp_dim // tp_size, c.eps)
            for _ in range(c.num_layers))
        self.norm_out = NormOut(dim, c.eps)
        self.proj_out = nn.Linear(dim, c.out_features, bias=False)

    # -- the two entry points

    def prefill(self, text, cond, target, timestep, index, block_ids, key_valid, rope_cos, rope_sin):
        """The first step over the whole sequence.

        text [B, T, context_in_dim]: the text encoder's rows (image-slot rows included; never read);
        cond [B, I, in_features] or None (text-to-image): the condition images' latents, in prefix order;
        target [B, N, in_features]: the target's latents; timestep [B]: t / 1000 as diffusers' pipeline passes it;
        index, block_ids [P] and key_valid [B, P]: sequence.prefix_inputs; rope_cos/sin [P + N, head_dim / 2]:
        sequence.rope_tables.
        Returns (prediction [B, N, out_features], k, v [layers, B, heads, P, head_dim]).
        """
        rows = self.txt_in(text)
        if cond is not None:
            rows = torch.cat([rows, self.img_in(cond)], 1)
        prefix = rows.index_select(1, index)
        x = self.img_in(target)
        temb, mod = self._modulation(timestep, x.dtype)
        _, mod0 = self._modulation(self.prefix_timestep(timestep), x.dtype)
        prefix_bias = self.prefix_attention_bias(block_ids, key_valid, x.dtype)
        target_bias = target_attention_bias(key_valid, x.shape[1], x.dtype)
        x, k, v = self.prefill_blocks(prefix, x, (mod0, mod, rope_cos, rope_sin, prefix_bias, target_bias))
        return self._output(x, temb), k, v

    def decode(self, target, timestep, k, v, key_valid, rope_cos, rope_sin):
        """A later step: target [B, N, in_features], timestep [B], the prefill's k, v [layers, B, heads, P,
        head_dim], key_valid [B, P], rope_cos/sin [N, head_dim / 2] (rope_tables' rows [P:]).
        Returns the prediction [B, N, out_features]."""
        x = self.img_in(target)
        temb, mod = self._modulation(timestep, x.dtype)
        bias = target_attention_bias(key_valid, x.shape[1], x.dtype)
        return self._output(self.decode_blocks(x, k, v, (mod, rope_cos, rope_sin, bias)), temb)

    # -- the layer loops: unrolled here, one scan over stacked weights in qic.models.qwen_image_21.looped

    def prefill_blocks(self, prefix, x, invariants):
        """(x after every block, k, v [layers, B, heads, P, head_dim])."""
        ks, vs = [], []
        for block in self.transformer_blocks:
            prefix, x, k, v = prefill_layer(block, prefix, x, *invariants)
            ks.append(k)
            vs.append(v)
        return x, torch.stack(ks), torch.stack(vs)

    def decode_blocks(self, x, k, v, invariants):
        for i, block in enumerate(self.transformer_blocks):
            x = decode_layer(block, x, k[i], v[i], *invariants)
        return x

    # -- the rules that make the prefix cacheable, one place each (a test breaks each on purpose)

    @staticmethod
    def prefix_timestep(timestep: torch.Tensor) -> torch.Tensor:
        """causal_condition: text and condition tokens are modulated at t = 0 (one row serves the batch)."""
        return timestep.new_zeros(1)

    prefix_attention_bias = staticmethod(prefix_attention_bias)

    # -- pieces

    def _modulation(self, timestep, dtype):
        """(temb [B, dim], the shared modulation [B, 4 * dim]). diffusers rounds t to the model dtype first."""
        proj = timestep_proj(timestep.to(dtype)).to(dtype)
        temb = self.time_text_embed.timestep_embedder(proj)
        return temb, self.modulation(temb)

    def _output(self, x, temb):
        return self.proj_out(self.norm_out(x, temb))


def denoiser_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> QwenImage21Denoiser state dict: diffusers' names verbatim, no renaming."""
    return dict(mapping)

