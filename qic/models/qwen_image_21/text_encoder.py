"""Qwen-Image-2.1's text encoder: the Qwen3-VL language model, prefill only, as QwenImage21Pipeline reads it.

What the pipeline takes (diffusers 0.42 `_get_qwen_prompt_embeds`): the LAST decoder layer's hidden state BEFORE
the final RMSNorm (it hooks `norm` to return its input), its valid tokens only, less the leading system-prompt
tokens (`_drop_idx`, the tokenized system message). Condition images enter as the vision tower's features written
over the `<|image_pad|>` embeddings, plus Qwen3-VL's deepstack: after decoder layer i (i < number of deepstack
features) the i-th deepstack feature is added at those same positions. The final norm's weight is therefore
never read; `model.norm.weight` is still loaded so the checkpoint's names load strict.

Differences from Qwen2.5-VL (qic's Qwen-Image encoder): per-head RMSNorm on q and k before RoPE, no q/k/v bias
(unless `attention_bias`), head_dim from the config (not hidden / heads), and *interleaved* mRoPE: frequency j takes
its position from the height axis when j % 3 == 1 (j < 3 * sections[1]), the width axis when j % 3 == 2
(j < 3 * sections[2]), else the temporal axis. For text all three axes carry the same position, so text-only
input is plain 1-D RoPE. Image tokens get 3-D positions; `mrope_positions` computes them on the host from
Python ints, as transformers' `get_rope_index` does, and the graph takes them as an input.

Padding: on the right, to a bucket. Causal attention then leaves the valid tokens exactly as the pipeline sees
one unpadded prompt. The pipeline left-pads a batch of prompts; RoPE is relative (a row's positions shifted by
its padding change no score), so its valid outputs agree with these within fp32 rounding (tested on the
pipeline's own encode).

LoopedQwenImage21TextEncoder is the same model over stacked layer weights (one loop body whatever the depth).

Compile-friendly: static shapes, no `.item()`/`.tolist()`, no buffers, the image slots found in-graph from the
token ids (a cumsum gives each slot its feature row), RoPE cos/sin from the positions in-graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.family import COLUMN, ROW, TPPlan
from qic.models.common import RowLinear, VocabEmbedding, check_config_keys, image_slots, rotate_half

COMPONENT = "text_encoder"


_TEXT_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_bias",
}
# Keys with no effect on prefill arithmetic (token ids, generation and training settings, dtype).
_TEXT_IGNORED = {
    "model_type", "dtype", "torch_dtype", "initializer_range", "use_cache", "attention_dropout",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version",
    "architectures", "tie_word_embeddings", "output_hidden_states", "output_attentions", "return_dict",
}
_TOP_KEYS = {"text_config", "vision_config", "image_token_id"}
_TOP_IGNORED = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "tie_word_embeddings",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "output_hidden_states", "return_dict",
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "mrope_section", "mrope_interleaved"}


@dataclass(frozen=True)
class TextEncoder21Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    attention_bias: bool
    image_token_id: int
    deepstack_layers: int  # len(vision_config.deepstack_visual_indexes): decoder layers that add a feature
    spatial_merge_size: int  # vision_config's: one image token per merge x merge patches

    @classmethod
    def from_dict(cls, d: Mapping) -> "TextEncoder21Config":
        """Parse text_encoder/config.json (Qwen3VLConfig: nested text_config and vision_config; the hub's
        transformers 4.57 spelling rope_scaling + rope_theta, or 5.x's rope_parameters)."""
        check_config_keys(d, _TOP_KEYS | _TOP_IGNORED, COMPONENT)
        t, v = d.get("text_config"), d.get("vision_config")
        if not isinstance(t, Mapping) or not isinstance(v, Mapping):
            raise ConfigError(f"{COMPONENT} config needs text_config and vision_config mappings (a Qwen3VLConfig)")
        check_config_keys(t, _TEXT_KEYS | _TEXT_IGNORED, COMPONENT)

        def need(m, key, where="text_config"):
            if m.get(key) is None:
                raise ConfigError(f"{COMPONENT} config lacks {where}.{key}")
            return m[key]

        def refuse(key, value, why):
            raise ConfigError(f"{COMPONENT} config sets {key}={value!r}; {why}")

        if t.get("hidden_act", "silu") != "silu":
            refuse("text_config.hidden_act", t["hidden_act"], "qic implements only silu")
        rope_key = "rope_scaling" if t.get("rope_scaling") is not None else "rope_parameters"
        rope = t.get(rope_key) or {}
        if not isinstance(rope, Mapping):
            refuse(f"text_config.{rope_key}", rope, "expected a mapping")
        extra = sorted(set(rope) - _ROPE_KEYS)
        if extra:
            refuse(f"text_config.{rope_key}.{extra[0]}", rope[extra[0]], "qic implements only default mRoPE")
        for key in ("rope_type", "type"):
            if rope.get(key, "default") != "default":
                refuse(f"text_config.{rope_key}.{key}", rope[key], "qic implements only default")
        # transformers' Qwen3-VL always interleaves (it never reads the flag); a False would be another model.
        if rope.get("mrope_interleaved", True) is not True:
            refuse(f"text_config.{rope_key}.mrope_interleaved", rope["mrope_interleaved"],
                   "qic implements Qwen3-VL's interleaved mRoPE only")
        theta = rope.get("rope_theta", t.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{COMPONENT} config lacks text_config.rope_theta")
        section = tuple(rope.get("mrope_section", (24, 20, 20)))  # transformers' default when absent

        heads = _positive(need(t, "num_attention_heads"), "num_attention_heads")
        kv = t.get("num_key_value_heads")
        hidden = _positive(need(t, "hidden_size"), "hidden_size")
        head_dim = t.get("head_dim") or hidden // heads
        deepstack = v.get("deepstack_visual_indexes", (8, 16, 24))
        cfg = cls(
            vocab_size=_positive(need(t, "vocab_size"), "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(need(t, "intermediate_size"), "intermediate_size"),
            num_layers=_positive(need(t, "num_hidden_layers"), "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_positive(kv, "num_key_value_heads") if kv is not None else heads,
            head_dim=_positive(head_dim, "head_dim"),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            mrope_section=section,
            attention_bias=bool(t.get("attention_bias", False)),
            image_token_id=int(d.get("image_token_id", 151655)),
            deepstack_layers=len(deepstack),
            spatial_merge_size=_positive(v.get("spatial_merge_size", 2), "vision_config.spatial_merge_size"),
        )
        if cfg.head_dim % 2:
            refuse("text_config.head_dim", cfg.head_dim, "RoPE needs an even head_dim")
        if cfg.num_heads % cfg.num_kv_heads:
            refuse("text_config.num_key_value_heads", cfg.num_kv_heads,
                   f"it does not divide num_attention_heads={cfg.num_heads}")
        if len(section) != 3 or sum(section) != cfg.head_dim // 2:
            refuse(f"text_config.{rope_key}.mrope_section", list(section),
                   f"three sections summing to head_dim / 2 = {cfg.head_dim // 2}")
        if cfg.deepstack_layers > cfg.num_layers:
            refuse("vision_config.deepstack_visual_indexes", list(deepstack),
                   f"more deepstack features than the {cfg.num_layers} decoder layers")
        if v.get("out_hidden_size", hidden) != hidden:
            refuse("vision_config.out_hidden_size", v["out_hidden_size"], f"it must equal hidden_size={hidden}")
        return cfg


def _positive(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{COMPONENT} config sets {key}={value!r}; expected a positive integer")
    return value


# ---------------------------------------------------------------------------------------------- weights

def text_encoder_tensor_name(name: str) -> str | None:
    """The module's name for one checkpoint tensor, or None for one the language model does not read.

    The hub (transformers 4.57) stores model.language_model.*, model.visual.*, lm_head.weight, which is also
    transformers 5's state_dict: the language model's names load as they are."""
    if name.startswith(("lm_head.", "model.visual.", "visual.")):
        return None
    return name


def text_encoder_state_dict(names_to_tensors: Mapping) -> dict:
    """The language-model tensors of a full Qwen3-VL checkpoint mapping, values untouched (maybe lazy).
    Other names pass through, so load_weights names them as unexpected."""
    return {own: t for name, t in names_to_tensors.items() if (own := text_encoder_tensor_name(name)) is not None}


# Megatron split, as Qwen3-VL's own base_model_tp_plan: q/k/v/gate/up by output rows, o/down by input columns,
# the vocabulary by rows (padded when it does not divide). q_norm/k_norm act per head on head_dim: replicated.
_L = r"model\.language_model\.layers\.\d+"
TP_PLAN = TPPlan(
    rules=(
        (_L + r"\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
        (_L + r"\.self_attn\.o_proj\.weight", ROW),
        (_L + r"\.mlp\.(gate|up)_proj\.weight", COLUMN),
        (_L + r"\.mlp\.down_proj\.weight", ROW),
        (r"model\.language_model\.embed_tokens\.weight", COLUMN),
    ),
    rank_tensors={"model.language_model.embed_tokens.vocab_start": ("model.language_model.embed_tokens.weight", 0)},
    padded=("model.language_model.embed_tokens.weight",),
)


# ---------------------------------------------------------------------------------------------- host side

# ---------------------------------------------------------------------------------------------- modules

def _tp_local(count: int, tp_size: int, what: str) -> int:
    if count % tp_size:
        raise ConfigError(f"{COMPONENT}: {what}={count} is not divisible by tp_size={tp_size}")
    return count // tp_size


class _RMSNorm(nn.Module):
    """Qwen3-VL's RMSNorm: normalised in fp32, cast back, THEN scaled by the weight in the input dtype
    (qic.models.common.RMSNorm scales in fp32: the same in fp32, one rounding apart in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: TextEncoder21Config, tp_size: int):
        super().__init__()
        d = self.head_dim = cfg.head_dim
        self.heads = _tp_local(cfg.num_heads, tp_size, "num_attention_heads")
        self.kv_heads = _tp_local(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.o_proj = RowLinear(self.heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = _RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = _RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask_bias):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # GQA by an explicit repeat (query head h reads kv head h // rep), so every back end sees plain attention.
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
            v = v[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bias, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, cfg: TextEncoder21Config, tp_size: int):
        super().__init__()
        width = _tp_local(cfg.intermediate_size, tp_size, "intermediate_size")
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = RowLinear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: TextEncoder21Config, tp_size: int):
        super().__init__()
        self.self_attn = _Attention(cfg, tp_size)
        self.mlp = _MLP(cfg, tp_size)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask_bias):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask_bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class _LanguageModel(nn.Module):
    """The checkpoint's model.language_model.{embed_tokens, layers.{i}, norm}."""

    def __init__(self, cfg: TextEncoder21Config, tp_size: int):
        super().__init__()
        _tp_local(cfg.num_heads, tp_size, "num_attention_heads")  # the usual TP limits are named first
        _tp_local(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        # Vocab-parallel: ceil(vocab / tp) rows a rank, zero rows past the end (the plan's padded split).
        self.embed_tokens = VocabEmbedding(-(-cfg.vocab_size // tp_size) * tp_size, cfg.hidden_size, tp_size)
        self.layers = nn.ModuleList(_DecoderLayer(cfg, tp_size) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # loaded for strictness; the pipeline skips it


class _Model(nn.Module):
    def __init__(self, cfg: TextEncoder21Config, tp_size: int):
        super().__init__()
        self.language_model = _LanguageModel(cfg, tp_size)


class QwenImage21TextEncoder(nn.Module):
    """Qwen3-VL language-model prefill -> the pipeline's prompt embeddings, [B, L - drop_tokens, hidden].

    State-dict keys are the checkpoint's: model.language_model.{embed_tokens.weight, layers.{i}.self_attn.
    {q,k,v,o}_proj.weight, .{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.{input,post_attention}_layernorm.weight, norm.weight}. With tp_size > 1 it holds one rank's
    shard (TP_PLAN) and the embedding's per-rank `vocab_start`; the plan sets the RowLinear/VocabEmbedding
    reductions from outside.

    drop_tokens: the system-message tokens the pipeline drops (its `_drop_idx`), a bucket-time constant.
    """

    def __init__(self, config: TextEncoder21Config, tp_size: int = 1, drop_tokens: int = 0):
        super().__init__()
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"{COMPONENT}: tp_size={tp_size!r}; expected a positive integer")
        if drop_tokens < 0:
            raise ConfigError(f"{COMPONENT}: drop_tokens={drop_tokens}; expected >= 0")
        self.config = config
        self.tp_size = tp_size
        self.drop_tokens = drop_tokens
        self.model = _Model(config, tp_size)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [L, head_dim] for mRoPE positions [3, L], in transformers' fp32 arithmetic
        (inv_freq = 1 / theta^(2j/d), angle = pos * inv_freq), cast to `dtype` last; no buffers, so a bf16 cast
        of the module cannot touch the frequencies."""
        cfg, dev = self.config, position_ids.device
        d, half = cfg.head_dim, cfg.head_dim // 2
        # theta as an fp32 tensor: traced for XLA a Python float becomes an f64 parameter
        theta = torch.tensor(cfg.rope_theta, dtype=torch.float32, device=dev)
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
        angles = position_ids.float()[:, :, None] * inv_freq  # [3, L, half]: each axis at every frequency
        j = torch.arange(half, device=dev)
        use_h = (j % 3 == 1) & (j < 3 * cfg.mrope_section[1])
        use_w = (j % 3 == 2) & (j < 3 * cfg.mrope_section[2])
        angles = torch.where(use_h, angles[1], torch.where(use_w, angles[2], angles[0]))
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] int64, right-padded; attention_mask [B, L] (nonzero = valid).
        position_ids [3, L] int64 (mrope_positions), shared by the batch; None: text only, 0..L-1.
        image_embeds [N, hidden]: the vision tower's merged features of every image in order, written over each
        row's N <|image_pad|> tokens (every row holds the same images, as in the pipeline); deepstack_embeds
        [deepstack_layers, N, hidden], added at those positions after the first decoder layers.

        Returns the last layer's pre-norm hidden state from token drop_tokens on, zero at padded positions (the
        pipeline's zero padding of prompt_embeds): [B, L - drop_tokens, hidden].
        """
        if deepstack_embeds is not None and image_embeds is None:
            raise ConfigError(f"{COMPONENT}: deepstack_embeds need image_embeds (the image slots they add to)")
        x = self.model.language_model.embed_tokens(input_ids)
        n = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(n, device=x.device)[None].expand(3, n)
        cos, sin = self.rope(position_ids, x.dtype)
        if image_embeds is not None:
            is_image, slot = image_slots(input_ids, attention_mask, self.config.image_token_id, image_embeds.shape[0])
            x = torch.where(is_image[..., None], image_embeds.to(x.dtype)[slot], x)
        # Causal AND key padding as an additive bias; a finite minimum (not -inf) keeps rows with no visible key
        # finite. The fill value is a tensor: a Python float traces to an fp64 XLA parameter.
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & (attention_mask != 0)[:, None, None, :]
        lowest = torch.full((), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask_bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, lowest)
        layers = self.model.language_model.layers
        # Written with slices so the looped form (a StackedLayers, whose slices are single callables over rows
        # of its stacks) runs this same code: the deepstack layers one by one, the rest as one loop.
        deep = self.config.deepstack_layers if deepstack_embeds is not None else 0
        for i in range(deep):
            for layer in layers[i:i + 1]:
                x = layer(x, cos, sin, mask_bias)
            x = torch.where(is_image[..., None], x + deepstack_embeds[i].to(x.dtype)[slot], x)
        for layer in layers[deep:]:
            x = layer(x, cos, sin, mask_bias)
        x = x[:, self.drop_tokens:]
        return torch.where((attention_mask[:, self.drop_tokens:] != 0)[..., None], x, x.new_zeros(()))


LAYER_PREFIX = "model.language_model.layers"


class LoopedQwenImage21TextEncoder(QwenImage21TextEncoder):
    """The same encoder with its decoder layers stacked [num_layers, ...] and run by one device-side loop
    (qic.models.looped.StackedLayers): the graph holds one layer body whatever the depth (36 in 2.1). The
    deepstack layers run as one-layer slices of the stacks, the rest as one loop; same forward and outputs.

    state_dict: the unrolled names outside the layers + `model.language_model.layers.stacked.<layer name>`;
    convert with qic.models.looped.stack_block_weights(sd, LAYER_PREFIX, num_layers).
    """

    def __init__(self, config: TextEncoder21Config, tp_size: int = 1, drop_tokens: int = 0):
        from qic.models.looped import StackedLayers  # not at import: looped imports the Qwen-Image models
        super().__init__(dataclasses.replace(config, num_layers=0), tp_size, drop_tokens)
        self.config = config
        # one layer exactly as the unrolled model builds it; free under torch.device("meta")
        template = QwenImage21TextEncoder(dataclasses.replace(config, num_layers=1), tp_size)
        self.model.language_model.layers = StackedLayers(template.model.language_model.layers[0],
                                                         config.num_layers, num_carry=1)
