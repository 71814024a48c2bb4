"""qic's Qwen-Image denoiser: the dual-stream MMDiT of diffusers' QwenImageTransformer2DModel, compile-friendly.

Same arithmetic and the same tensor names as diffusers, written for one static graph per resolution bucket:
no complex numbers (RoPE uses real cos/sin tables with diffusers' interleaved (2i, 2i+1) pairing), no
data-dependent Python control flow, no host syncs. It exports whole with torch.export.export.

RoPE tables are inputs to forward, not computed inside it. `rope_tables(config, h, w, txt_len)` is a pure
host-side function of static ints: compute it once per (resolution, text bucket) at build time or at load
time, and feed the same two tensors to every step. This keeps the graph free of trig over large angles (which
some accelerators evaluate poorly, see the Trainium note) and keeps a bucket's graph independent of how the
tables were produced. Layout: joint token order [text | image], shape [txt_len + h*w, head_dim // 2], fp32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.models.common import (
    GatherLinear,
    Linear,
    RMSNorm,
    RowLinear,
    apply_rope,
    check_config_keys,
    heads_first,
    require_value,
)
from qic.models.looped import StackedLayers, template_layer
from qic.models.qwen_image.host.rope import grid_tables
from qic.models.qwen_image.host.rope import position_tables as host_position_tables

COMPONENT = "transformer"
# Architecture constants of diffusers' class (not in config.json): FeedForward's default mult, the
# sinusoidal timestep projection width (RoPE's: qic.models.qwen_image.host.rope).
MLP_RATIO = 4
TIME_PROJ_DIM = 256
EPS = 1e-6

_SIZE_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
              "num_attention_heads", "joint_attention_dim", "axes_dims_rope")
# Variant flags: known, but qic implements only the plain model (value off).
_OFF_FLAGS = ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope")
# Implemented flags: Edit-2511's zero_cond_t (condition-image tokens modulated at timestep 0).
_FLAGS = ("zero_cond_t",)
# The hub's Qwen-Image config carries pooled_projection_dim (768); diffusers' class ignores it, so do we.
_IGNORED_KEYS = ("pooled_projection_dim",)


@dataclass(frozen=True)
class MMDiTConfig:
    patch_size: int
    in_channels: int
    out_channels: int
    num_layers: int
    attention_head_dim: int
    num_attention_heads: int
    joint_attention_dim: int
    axes_dims_rope: tuple[int, int, int]
    # Edit-2511: the condition images' tokens are modulated by the timestep-0 embedding (diffusers' timestep
    # batch [t, 0] and per-token modulate_index); text and the output norm keep t's. Without condition tokens
    # the model is the plain one.
    zero_cond_t: bool = False

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return MLP_RATIO * self.inner_dim

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels

    @classmethod
    def from_dict(cls, d: Mapping) -> MMDiTConfig:
        """Parse transformer/config.json; refuse unknown keys and variant flags qic does not implement."""
        check_config_keys(d, _SIZE_KEYS + _OFF_FLAGS + _FLAGS + _IGNORED_KEYS, COMPONENT)
        for flag in _OFF_FLAGS:
            require_value(d, flag, (False,), COMPONENT)
        missing = [k for k in _SIZE_KEYS if k not in d and k != "out_channels"]
        if missing:
            raise ConfigError(f"{COMPONENT} config lacks {', '.join(missing)}")
        axes = tuple(int(a) for a in d["axes_dims_rope"])
        # diffusers: out_channels null means in_channels
        out_channels = d.get("out_channels") or d["in_channels"]
        require_value(d, "zero_cond_t", (False, True), COMPONENT)
        cfg = cls(int(d["patch_size"]), int(d["in_channels"]), int(out_channels), int(d["num_layers"]),
                  int(d["attention_head_dim"]), int(d["num_attention_heads"]), int(d["joint_attention_dim"]),
                  axes, bool(d.get("zero_cond_t", False)))
        if len(axes) != 3 or any(a % 2 for a in axes):
            raise ConfigError(f"{COMPONENT} config axes_dims_rope={list(axes)} must be three even sizes")
        if sum(axes) != cfg.attention_head_dim:
            raise ConfigError(f"{COMPONENT} config axes_dims_rope={list(axes)} sums to {sum(axes)}, "
                              f"but attention_head_dim is {cfg.attention_head_dim}")
        return cfg


# ---------------------------------------------------------------- RoPE (host side: qic.models.qwen_image.host.rope)

def rope_tables(config: MMDiTConfig, height: int, width: int, txt_len: int,
                conditions: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [txt_len + h*w (+ the conditions' tokens), head_dim // 2] fp32, for a packed grid
    height x width (pixels / vae_scale / patch) and the packed grids of condition images (editing's)."""
    return grid_tables(config.axes_dims_rope, height, width, txt_len, conditions)


def position_tables(config: MMDiTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of int64 (frame, row, col) positions [N, 3]: [N, head_dim // 2] each, fp32."""
    return host_position_tables(config.axes_dims_rope, pos)


# ---------------------------------------------------------------- modules (names mirror diffusers' tensors)

def timestep_proj(t: torch.Tensor) -> torch.Tensor:
    """diffusers' Timesteps(256, flip_sin_to_cos=True, shift 0, scale 1000): [cos | sin] of t * 1000 * f_k.

    Frequencies and product in fp32, as diffusers' get_timestep_embedding computes them whatever the
    model dtype. Rounding the frequencies to bf16 (relative error 2^-9) moves the angle t * 1000 * f by up
    to ~2 rad at t = 1: a bf16 step run eagerly, or lowered to XLA (explicit converts), was then 15x less
    accurate than diffusers' (rel-L2 0.115 vs 0.0077 against fp32; inductor happened to fuse the
    round trip away). tests/test_bf16_fidelity.py.
    """
    half = TIME_PROJ_DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = 1000 * (t[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class TimestepEmbedder(nn.Module):
    """linear_1 column-parallel, silu, linear_2 row-parallel (a Megatron MLP on the [B, dim] embedding)."""

    def __init__(self, dim: int, tp_size: int = 1):
        super().__init__()
        self.linear_1 = Linear(TIME_PROJ_DIM, dim // tp_size)
        self.linear_2 = RowLinear(dim // tp_size, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int, tp_size: int = 1):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim, tp_size)


class GeluProj(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = Linear(dim_in, dim_out)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """net.0.proj (column-parallel) -> gelu tanh -> net.2 (row-parallel); net.1 is diffusers' dropout."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, hidden), nn.Identity(), RowLinear(hidden, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class JointAttention(nn.Module):
    """Joint attention over [text | image]: per-stream QKV and QK-RMSNorm, shared RoPE table and SDPA (packed CFG:
    one SDPA per branch, each over its own tokens and RoPE table; forward).

    `exchange` (None, or Ulysses' all-to-all hook, set by qic.parallel.sequence): under sequence parallelism
    the streams hold this rank's tokens only; q/k/v (RoPE applied per token) are exchanged for all tokens of
    a 1/U part of the heads, attended over the whole sequence, and exchanged back."""

    exchange = None

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        local = heads * head_dim  # heads here is already the per-rank count
        self.to_q, self.to_k, self.to_v = (Linear(dim, local) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (Linear(dim, local) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, EPS), RMSNorm(head_dim, EPS)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, EPS), RMSNorm(head_dim, EPS)
        self.to_out = nn.ModuleList([RowLinear(local, dim)])
        self.to_add_out = RowLinear(local, dim)

    def forward(self, img, txt, attn_mask, cos, sin, neg_cos=None, neg_sin=None):
        """neg_cos / neg_sin: packed CFG (QwenMMDiT.forward's negative_rope): img [2, S] the cond and uncond rows,
        txt [1, Lc + Lu] both branches' text one after the other, cos / sin the cond branch's tables over
        [Lc text | S image] and neg_cos / neg_sin the uncond branch's over [Lu | S]; each branch attends over its
        own tokens, as two calls of the model at the prompts' own lengths would."""
        def heads(x):
            return x.unflatten(-1, (-1, self.head_dim))  # [B, S, H, D]

        if neg_cos is not None:
            return self._packed(img, txt, heads, (cos, sin), (neg_cos, neg_sin))
        q = torch.cat([self.norm_added_q(heads(self.add_q_proj(txt))), self.norm_q(heads(self.to_q(img)))], 1)
        k = torch.cat([self.norm_added_k(heads(self.add_k_proj(txt))), self.norm_k(heads(self.to_k(img)))], 1)
        v = torch.cat([heads(self.add_v_proj(txt)), heads(self.to_v(img))], 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.exchange is not None:
            q, k, v = self.exchange.to_heads(q, k, v)
        # attn_mask None is the fast path: plain SDPA, no mask tensor in the graph at all.
        out = F.scaled_dot_product_attention(*heads_first(q, k, v), attn_mask=attn_mask).transpose(1, 2)
        if self.exchange is not None:
            out = self.exchange.to_tokens(out)
        out = out.flatten(2).to(q.dtype)
        n_txt = txt.shape[1]
        return self.to_out[0](out[:, n_txt:].contiguous()), self.to_add_out(out[:, :n_txt].contiguous())

    def _packed(self, img, txt, heads, cond_rope, neg_rope):
        """forward's packed CFG: the projections over every token at once (no padded rows), attention per branch."""
        if self.exchange is not None:
            raise ValueError("packed CFG text under Ulysses is not implemented")
        qt, kt = self.norm_added_q(heads(self.add_q_proj(txt))), self.norm_added_k(heads(self.add_k_proj(txt)))
        vt = heads(self.add_v_proj(txt))
        qi, ki, vi = self.norm_q(heads(self.to_q(img))), self.norm_k(heads(self.to_k(img))), heads(self.to_v(img))
        n_img = img.shape[1]
        n_cond = cond_rope[0].shape[0] - n_img           # the cond branch's text tokens lead the packed text
        texts, images = [], []
        for b, (rows, (cos, sin)) in enumerate(((slice(None, n_cond), cond_rope), (slice(n_cond, None), neg_rope))):
            q = apply_rope(torch.cat([qt[:, rows], qi[b:b + 1]], 1), cos, sin)
            k = apply_rope(torch.cat([kt[:, rows], ki[b:b + 1]], 1), cos, sin)
            v = torch.cat([vt[:, rows], vi[b:b + 1]], 1)
            out = F.scaled_dot_product_attention(*heads_first(q, k, v)).transpose(1, 2).flatten(2).to(q.dtype)
            n_txt = out.shape[1] - n_img
            texts.append(out[:, :n_txt])
            images.append(out[:, n_txt:])
        return (self.to_out[0](torch.cat(images, 0).contiguous()),
                self.to_add_out(torch.cat(texts, 1).contiguous()))


def _modulate(x, shift, scale):
    # shift, scale: [B, 1, D] (every token alike) or [B, S, D] (per token: zero_cond_t's image stream)
    return x * (1 + scale) + shift


def _per_token(params, cond_params, cond_tokens):
    """[B, 1, D] chunks, or with zero_cond_t each image token's: cond_params' where cond_tokens ([1, S, 1] bool,
    the condition images' tokens) is set, params' elsewhere (diffusers' torch.where over modulate_index)."""
    if cond_params is None:
        return [p[:, None] for p in params]
    return [torch.where(cond_tokens, c[:, None], p[:, None]) for p, c in zip(params, cond_params)]


class MMDiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, tp_size: int = 1):
        super().__init__()
        # Modulation: column-parallel, its small [B, 6 * dim] output gathered whole (every rank needs all six).
        self.img_mod = nn.Sequential(nn.SiLU(), GatherLinear(dim, 6 * dim // tp_size))
        self.txt_mod = nn.Sequential(nn.SiLU(), GatherLinear(dim, 6 * dim // tp_size))
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_mlp = FeedForward(dim, mlp_hidden)
        self.txt_mlp = FeedForward(dim, mlp_hidden)
        self.dim = dim

    def _ln(self, x):
        return F.layer_norm(x, (self.dim,), eps=EPS)

    def forward(self, img, txt, temb, attn_mask, cos, sin, cond_temb=None, cond_tokens=None, neg_cos=None,
                neg_sin=None):
        """cond_temb [B, D] / cond_tokens [1, S_img, 1] bool: zero_cond_t's timestep-0 embedding and which image
        tokens it modulates (None: every image token takes temb's). neg_cos / neg_sin: packed CFG (JointAttention),
        where temb is [1, D], the one timestep both branches share."""
        # Six chunks per stream: (shift, scale, gate) for the attention half, then for the MLP half.
        cond_params = None if cond_temb is None else self.img_mod(cond_temb).chunk(6, -1)
        i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = _per_token(self.img_mod(temb).chunk(6, -1), cond_params,
                                                           cond_tokens)
        t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = _per_token(self.txt_mod(temb).chunk(6, -1), None, None)
        img_attn, txt_attn = self.attn(_modulate(self._ln(img), i_sh1, i_sc1),
                                       _modulate(self._ln(txt), t_sh1, t_sc1), attn_mask, cos, sin, neg_cos, neg_sin)
        img = img + i_g1 * img_attn
        txt = txt + t_g1 * txt_attn
        img = img + i_g2 * self.img_mlp(_modulate(self._ln(img), i_sh2, i_sc2))
        txt = txt + t_g2 * self.txt_mlp(_modulate(self._ln(txt), t_sh2, t_sc2))
        if img.dtype == torch.float16:  # diffusers clips fp16 to avoid inf; a static dtype branch
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


class NormOut(nn.Module):
    """AdaLayerNormContinuous without affine: note the (scale, shift) order, unlike the blocks."""

    def __init__(self, dim: int, tp_size: int = 1):
        super().__init__()
        self.linear = GatherLinear(dim, 2 * dim // tp_size)  # column-parallel, [B, 2 * dim] gathered
        self.dim = dim

    def forward(self, x, temb):
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, -1)
        return F.layer_norm(x, (self.dim,), eps=EPS) * (1 + scale[:, None]) + shift[:, None]


class QwenMMDiT(nn.Module):
    """The denoiser. state_dict keys are diffusers' tensor names; with tp_size > 1 each rank holds
    heads // tp_size heads and mlp_dim // tp_size MLP columns, and a 1 / tp_size part of the modulation,
    timestep-embedding, text-input and output-norm projections; img_in and proj_out (thin: 64 latent
    channels) stay whole. The TP execution plan (the collectives) is set elsewhere."""

    def __init__(self, config: MMDiTConfig, tp_size: int = 1):
        super().__init__()
        c = config
        if c.num_attention_heads % tp_size or c.mlp_dim % tp_size:
            raise ConfigError(f"{COMPONENT}: tp_size {tp_size} does not divide {c.num_attention_heads} attention "
                              f"heads and {c.mlp_dim} MLP columns")
        self.config, self.tp_size = c, tp_size
        dim = c.inner_dim
        self.img_in = Linear(c.in_channels, dim)
        self.txt_norm = RMSNorm(c.joint_attention_dim, EPS)
        self.txt_in = GatherLinear(c.joint_attention_dim, dim // tp_size)  # column-parallel, gathered once
        self.time_text_embed = TimeTextEmbed(dim, tp_size)
        self.transformer_blocks = nn.ModuleList(
            MMDiTBlock(dim, c.num_attention_heads // tp_size, c.attention_head_dim, c.mlp_dim // tp_size, tp_size)
            for _ in range(c.num_layers))
        self.norm_out = NormOut(dim, tp_size)
        self.proj_out = Linear(dim, c.out_features)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor | None, timestep: torch.Tensor,
                rope_cos: torch.Tensor, rope_sin: torch.Tensor, condition: torch.Tensor | None = None,
                condition_mask: torch.Tensor | None = None, negative_rope: tuple | None = None) -> torch.Tensor:
        """hidden_states [B, S_img, in_ch] packed latents; encoder_hidden_states [B, S_txt, joint_dim];
        encoder_hidden_states_mask [B, S_txt] (nonzero = valid) or None when every token is valid;
        timestep [B] = t / 1000 as diffusers' pipeline passes it; rope_cos/sin from rope_tables(...,
        txt_len=S_txt, conditions=...). Editing: condition [B, S_cond, in_ch], the condition images' packed
        latents after the noise (diffusers' torch.cat([latents, image_latents], 1)), and condition_mask
        [B, S_cond] (nonzero = a real token; None: all are), its padding slots masked as keys like padded
        text. Packed CFG (negative_rope, the uncond branch's (cos, sin) over [its text | image]): hidden_states
        [2, S_img, in_ch] the cond and uncond rows of one image, encoder_hidden_states [1, Lc + Lu, joint_dim] the
        prompt's then the negative prompt's text at their own lengths, no mask, timestep [1], rope_cos / rope_sin
        the cond branch's tables: the two branches' predictions [2, ...] without computing padded text rows.
        Returns [B, S_img, patch^2 * out_channels]: the noise tokens' prediction only."""
        noise_tokens = hidden_states.shape[1]
        if condition is not None:
            hidden_states = torch.cat([hidden_states, condition.to(hidden_states.dtype)], 1)
        img, txt, temb = self.embed(hidden_states, encoder_hidden_states, timestep)
        cond_temb = cond_tokens = None
        if condition is not None and self.config.zero_cond_t:
            cond_temb = self.time_embedding(timestep * 0, img.dtype)
            cond_tokens = (torch.arange(img.shape[1], device=img.device) >= noise_tokens)[None, :, None]
        attn_mask = self.attention_mask(encoder_hidden_states_mask, img, condition_mask, txt)
        neg_cos, neg_sin = negative_rope or (None, None)
        img, txt = self.blocks(img, txt, temb, attn_mask, rope_cos, rope_sin, cond_temb=cond_temb,
                               cond_tokens=cond_tokens, neg_cos=neg_cos, neg_sin=neg_sin)
        return self.output(img[:, :noise_tokens], temb)

    # The forward's three parts, also called one by one by the step-caching graphs
    # (qic/models/qwen_image/step_cache.py), which run a range of the blocks each: one definition of the arithmetic
    # for both.

    def embed(self, hidden_states, encoder_hidden_states, timestep):
        """(img [B, S_img, dim], txt [B, S_txt, dim], temb [B, dim]): the input projections and timestep embedding."""
        img = self.img_in(hidden_states)
        temb = self.time_embedding(timestep, img.dtype)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        return img, txt, temb

    def time_embedding(self, timestep, dtype):
        t = timestep.to(dtype)  # diffusers rounds t to the model dtype before embedding it
        return self.time_text_embed.timestep_embedder(timestep_proj(t).to(dtype))

    @staticmethod
    def attention_mask(encoder_hidden_states_mask, img, condition_mask=None, txt=None):
        """The key-padding mask over [text | image | conditions] (SDPA: True = attend), or None when every key is
        valid; the noise tokens always are. txt: the text stream, needed only for a condition mask without a
        text mask."""
        text_mask, batch, device = encoder_hidden_states_mask, img.shape[0], img.device
        if text_mask is None and condition_mask is None:
            return None
        if text_mask is None:
            text_mask = torch.ones(batch, txt.shape[1], dtype=torch.bool, device=device)
        cond = 0 if condition_mask is None else condition_mask.shape[1]
        parts = [text_mask.to(torch.bool), torch.ones(batch, img.shape[1] - cond, dtype=torch.bool, device=device)]
        if condition_mask is not None:
            parts.append(condition_mask.to(torch.bool))
        return torch.cat(parts, 1)[:, None, None, :]

    def blocks(self, img, txt, temb, attn_mask, rope_cos, rope_sin, start: int = 0, stop: int | None = None,
               cond_temb=None, cond_tokens=None, neg_cos=None, neg_sin=None):
        """Blocks start..stop-1 (all by default) over both streams. Slicing works for the unrolled block list
        and for the looped one (qic/models/looped.py: a slice of the stacked weights, no copy)."""
        for block in self.transformer_blocks[start:stop]:
            img, txt = block(img, txt, temb, attn_mask, rope_cos, rope_sin, cond_temb, cond_tokens, neg_cos, neg_sin)
        return img, txt

    def output(self, img, temb):
        return self.proj_out(self.norm_out(img, temb))


def mmdit_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> QwenMMDiT state dict. qic uses diffusers' names verbatim, so no renaming."""
    return dict(mapping)


class LoopedMMDiT(QwenMMDiT):
    """QwenMMDiT with its transformer blocks stacked and run by scan (qic.models.looped): same forward signature
    and outputs.

    state_dict: QwenMMDiT's non-block names + `transformer_blocks.stacked.<block-local name>` [L, ...].
    Convert an unrolled state dict with `stack_block_weights(sd, "transformer_blocks", L)`.
    """

    def __init__(self, config: MMDiTConfig, tp_size: int = 1):
        super().__init__(dataclasses.replace(config, num_layers=0), tp_size)
        self.config = config
        template = template_layer(QwenMMDiT, config, tp_size, lambda m: m.transformer_blocks)
        self.transformer_blocks = StackedLayers(template, config.num_layers, num_carry=2)
