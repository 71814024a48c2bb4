"""Qwen2.5-VL language model, prefill only: qic's text encoder for Qwen-Image.

Only the text path exists here: no vision tower, no KV cache, no lm_head. The forward returns the last
hidden state after the final RMSNorm, which is what diffusers' QwenImagePipeline takes
(`hidden_states[-1]` with output_hidden_states=True; transformers ties that entry to the normed output).

Written for ahead-of-time compilation: static shapes, real cos/sin RoPE (no complex numbers), no
data-dependent Python control flow, no `.item()`; the whole module exports with `torch.export.export`.

Text-only mRoPE is plain 1-D RoPE: for text, transformers gives all three mRoPE sections (temporal,
height, width) the same position, so re-assembling the sections gives back the ordinary table. Positions
are 0..L-1 for every row. transformers 5 uses exactly that for text-only input, whatever the mask;
transformers 4.x used cumsum(mask) - 1, which agrees on the valid tokens only when prompts are
RIGHT-padded. Right padding is the convention here (causal attention then leaves the valid tokens'
outputs exact); left padding matches transformers 5 but not 4.x.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import CheckpointError, ConfigError
from qic.models.common import RMSNorm, RowLinear, VocabEmbedding, check_config_keys, image_slots, rotate_half
from qic.models.looped import StackedLayers, template_layer

COMPONENT = "text_encoder"

# Keys that set the arithmetic; each is parsed (and refused where qic does not implement the value).
_ARITHMETIC_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}
# Keys that do not touch prefill arithmetic: token ids, generation/training settings, dtype, the vision
# tower, lm_head tying, and the generic fields transformers' PretrainedConfig writes.
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "vision_config",
    "text_config", "initializer_range", "use_cache", "attention_dropout", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "mrope_section"}
# 'mrope' is the older spelling; transformers maps it to 'default' (plain inv_freq, no scaling).
_ROPE_TYPES = ("default", "mrope")


@dataclass(frozen=True)
class TextEncoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float = 1000000.0  # transformers' default for Qwen2.5-VL (4.x and 5.x alike)
    # mRoPE's split of the rotary frequencies between the (temporal, height, width) positions: used with image
    # tokens (the Edit models' prompts); text alone has all three alike, plain RoPE.
    mrope_section: tuple[int, ...] | None = None
    image_token_id: int = 151655   # <|image_pad|>, the multimodal config's (Qwen2.5-VL's id by default)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: Mapping) -> "TextEncoderConfig":
        """Parse text_encoder/config.json: flat (hub, transformers 4.x) or nested `text_config` (5.x).

        In the nested form every text key is read from `text_config`; top-level keys are then the
        multimodal wrapper's and are not read (transformers ignores them for the language model too).
        """
        t = d["text_config"] if isinstance(d.get("text_config"), Mapping) else d
        check_config_keys(t, _ARITHMETIC_KEYS | _IGNORED_KEYS, COMPONENT)

        def need(key):
            if key not in t or t[key] is None:
                raise ConfigError(f"{COMPONENT} config lacks {key}")
            return t[key]

        def refuse(key, value, why):
            raise ConfigError(f"{COMPONENT} config sets {key}={value!r}; {why}")

        if t.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", t["hidden_act"], "qic implements only silu")
        if t.get("use_sliding_window", False):
            refuse("use_sliding_window", t["use_sliding_window"], "qic implements only full attention")
        for i, kind in enumerate(t.get("layer_types") or ()):
            if kind != "full_attention":
                refuse(f"layer_types[{i}]", kind, "qic implements only full_attention layers")

        # RoPE: flat configs carry rope_scaling + top-level rope_theta, nested ones rope_parameters.
        rope_key = "rope_scaling" if t.get("rope_scaling") is not None else "rope_parameters"
        rope = t.get(rope_key) or {}
        if not isinstance(rope, Mapping):
            refuse(rope_key, rope, "expected a mapping")
        extra = sorted(set(rope) - _ROPE_KEYS)
        if extra:
            refuse(f"{rope_key}.{extra[0]}", rope[extra[0]], "qic implements only default (m)RoPE")
        for key in ("rope_type", "type"):
            if key in rope and rope[key] not in _ROPE_TYPES:
                refuse(f"{rope_key}.{key}", rope[key], f"qic supports only {', '.join(_ROPE_TYPES)}")
        theta = rope.get("rope_theta", t.get("rope_theta", cls.rope_theta))
        if "rope_theta" in rope and t.get("rope_theta") is not None and t["rope_theta"] != rope["rope_theta"]:
            refuse("rope_theta", t["rope_theta"], f"it contradicts {rope_key}.rope_theta={rope['rope_theta']!r}")

        kv = t.get("num_key_value_heads")
        cfg = cls(
            vocab_size=_positive(need("vocab_size"), "vocab_size"),
            hidden_size=_positive(need("hidden_size"), "hidden_size"),
            intermediate_size=_positive(need("intermediate_size"), "intermediate_size"),
            num_layers=_positive(need("num_hidden_layers"), "num_hidden_layers"),
            num_heads=_positive(need("num_attention_heads"), "num_attention_heads"),
            num_kv_heads=_positive(kv, "num_key_value_heads") if kv is not None else t["num_attention_heads"],
            rms_norm_eps=float(need("rms_norm_eps")),
            rope_theta=float(theta),
            mrope_section=tuple(rope["mrope_section"]) if "mrope_section" in rope else None,
            image_token_id=int(d.get("image_token_id", t.get("image_token_id", cls.image_token_id))),
        )

        if cfg.hidden_size % cfg.num_heads:
            refuse("num_attention_heads", cfg.num_heads, f"it does not divide hidden_size={cfg.hidden_size}")
        if cfg.head_dim % 2:
            refuse("num_attention_heads", cfg.num_heads, f"head_dim {cfg.head_dim} is odd; RoPE needs it even")
        if cfg.num_heads % cfg.num_kv_heads:
            refuse("num_key_value_heads", cfg.num_kv_heads,
                   f"it does not divide num_attention_heads={cfg.num_heads}")
        # transformers' attention always uses hidden_size // heads; a different head_dim would be a variant.
        if t.get("head_dim") is not None and t["head_dim"] != cfg.head_dim:
            refuse("head_dim", t["head_dim"], f"qic needs hidden_size / num_attention_heads = {cfg.head_dim}")
        if cfg.mrope_section is not None and sum(cfg.mrope_section) != cfg.head_dim // 2:
            refuse(f"{rope_key}.mrope_section", list(cfg.mrope_section),
                   f"it must sum to head_dim / 2 = {cfg.head_dim // 2}")
        return cfg


def _positive(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{COMPONENT} config sets {key}={value!r}; expected a positive integer")
    return value


# ---------------------------------------------------------------------------------------------- weights

def text_encoder_tensor_name(name: str) -> str | None:
    """The module's name for one checkpoint tensor name, or None for a tensor qic does not load.

    Hub layout (transformers 4.x): model.{embed_tokens,layers,norm}.*, visual.*, lm_head.weight.
    transformers 5 layout: model.language_model.*, model.visual.*, lm_head.weight.
    Other names pass through unchanged, so load_weights reports them as unexpected.
    """
    if name.startswith(("lm_head.", "visual.", "model.visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def text_encoder_state_dict(names_to_tensors: Mapping) -> dict:
    """Select and rename the language-model tensors of a full text-encoder checkpoint mapping.

    Values are passed through untouched (they may be lazy handles). The result loads with
    `load_weights(QwenTextEncoder(cfg), sd, 'text_encoder')`.
    """
    out = {}
    for name, tensor in names_to_tensors.items():
        own = text_encoder_tensor_name(name)
        if own is None:
            continue
        if own in out:
            raise CheckpointError(f"{COMPONENT}: tensor {own} is stored twice (both naming layouts present?)")
        out[own] = tensor
    return out


# ---------------------------------------------------------------------------------------------- modules

def _tp_local(count: int, tp_size: int, what: str) -> int:
    if count % tp_size:
        raise ConfigError(f"{COMPONENT}: {what}={count} is not divisible by tp_size={tp_size}")
    return count // tp_size


class _Attention(nn.Module):
    def __init__(self, cfg: TextEncoderConfig, tp_size: int):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.heads = _tp_local(cfg.num_heads, tp_size, "num_attention_heads")
        self.kv_heads = _tp_local(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=True)
        self.o_proj = RowLinear(self.heads * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask_bias):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # GQA: query head h uses kv head h // (heads / kv_heads). Explicit repeat, not SDPA's enable_gqa,
        # so every backend sees plain equal-head attention.
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
            v = v[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bias, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, cfg: TextEncoderConfig, tp_size: int):
        super().__init__()
        width = _tp_local(cfg.intermediate_size, tp_size, "intermediate_size")
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = RowLinear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: TextEncoderConfig, tp_size: int):
        super().__init__()
        self.self_attn = _Attention(cfg, tp_size)
        self.mlp = _MLP(cfg, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask_bias):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask_bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class _LanguageModel(nn.Module):
    """Holds the tensors under the hub names: embed_tokens, layers.{i}, norm."""

    def __init__(self, cfg: TextEncoderConfig, tp_size: int):
        super().__init__()
        # Vocab-parallel under TP: each rank holds ceil(vocab_size / tp) rows (the real 152064 divides by 2, 4
        # and 8; a fine-tune's added tokens may not). The table is padded to tp times that with zero rows at
        # the end, which no token id reaches: the plan's PADDED slicing (qic.parallel.plans) writes them.
        # Built uninitialised: weights are always loaded, and the default normal_ init costs a 1 s import of
        # torch._dynamo.
        _tp_local(cfg.num_heads, tp_size, "num_attention_heads")  # the usual limit on TP is named first
        _tp_local(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        padded_vocab = -(-cfg.vocab_size // tp_size) * tp_size
        self.embed_tokens = VocabEmbedding(padded_vocab, cfg.hidden_size, tp_size)
        self.layers = nn.ModuleList(_DecoderLayer(cfg, tp_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class QwenTextEncoder(nn.Module):
    """Qwen2.5-VL language model prefill. State-dict keys: model.embed_tokens.weight,
    model.layers.{i}.self_attn.{q,k,v,o}_proj.*, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight (the hub's names).

    With tp_size > 1 the module holds one rank's shard shapes (heads, kv heads and MLP width divided by
    tp_size, ceil(vocab_size / tp_size) vocabulary rows, plus the embedding's per-rank
    `model.embed_tokens.vocab_start`);
    o_proj/down_proj are RowLinear and embed_tokens a VocabEmbedding, whose `reduce` the TP plan sets.
    """

    def __init__(self, config: TextEncoderConfig, tp_size: int = 1):
        super().__init__()
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"{COMPONENT}: tp_size={tp_size!r}; expected a positive integer")
        self.config = config
        self.tp_size = tp_size
        self.model = _LanguageModel(config, tp_size)

    def _inv_freq(self, device) -> torch.Tensor:
        """1 / theta^(2i/d) in fp32, from constants each call (no buffer a bf16 cast could degrade). theta as an fp32
        tensor, not a Python float: eager arithmetic is the same (a float scalar is rounded to fp32 for an fp32
        exponent), but traced for XLA a Python float becomes an f64 parameter, a dtype Trainium does not compute in."""
        d = self.config.head_dim
        theta = torch.full((), self.config.rope_theta, dtype=torch.float32, device=device)   # a factory op, not a
        # tensor made from a Python value: a graph would hold that as a constant of its own
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

    def rope(self, seq_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [seq_len, head_dim] for positions 0..seq_len-1.

        Same float32 arithmetic as transformers (inv_freq = 1 / theta^(2i/d), angle = pos * inv_freq),
        computed from constants each call rather than held in a buffer, so that casting the module to
        bf16 cannot degrade the frequencies. Cast to the activation dtype last, as transformers does.
        """
        angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * self._inv_freq(device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def mrope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [L, head_dim] for mRoPE positions [3, L] (temporal, height, width), as Qwen2.5-VL's
        apply_multimodal_rotary_pos_emb assembles them: the rotary frequencies in consecutive runs of
        mrope_section (16, 24, 24 in the hub's config), run k from axis k, over both halves of the head."""
        cfg, dev = self.config, position_ids.device
        if cfg.mrope_section is None:
            raise ConfigError(f"{COMPONENT} config has no mrope_section: image tokens need mRoPE's split")
        d = cfg.head_dim
        angles = position_ids.float()[:, :, None] * self._inv_freq(dev)   # [3, L, d/2]: each axis, every frequency
        # frequency k's axis: 0 below the first section's end, 1 below the second's, else 2 (arange comparisons,
        # not a tensor of the sections: a graph would hold that as a constant of its own)
        first, second = cfg.mrope_section[0], cfg.mrope_section[0] + cfg.mrope_section[1]
        k = torch.arange(d // 2, device=dev)
        axis = (k >= first).long() + (k >= second).long()
        angles = torch.where(axis == 1, angles[1], torch.where(axis == 2, angles[2], angles[0]))
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] int64; attention_mask [B, L] (1 valid, 0 padding; any dtype); pad on the right.
        Editing's prompts: position_ids [3, L] int64 mRoPE positions shared by the batch (the host's, as
        transformers' get_rope_index gives them), and image_embeds [N, hidden], the vision tower's features of
        every condition image in order, written over each row's N valid <|image_pad|> tokens.

        Returns the final-normed hidden state [B, L, hidden]. Padded positions hold finite values of no
        meaning.
        """
        x = self.model.embed_tokens(input_ids)
        n = input_ids.shape[1]
        cos, sin = self.rope(n, x.dtype, x.device) if position_ids is None else self.mrope(position_ids, x.dtype)
        if image_embeds is not None:
            is_image, slot = image_slots(input_ids, attention_mask, self.config.image_token_id, image_embeds.shape[0])
            x = torch.where(is_image[..., None], image_embeds.to(x.dtype)[slot], x)
        # Causal AND key-padding, as an additive bias. A finite minimum instead of -inf keeps rows
        # with no visible key (left padding) finite instead of NaN; NaN in a padded row would poison
        # anything that later multiplies it by a zero mask.
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & (attention_mask != 0)[:, None, None, :]
        mask_bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device)
        # The fill value as a tensor of x's dtype: a Python float traces to an fp64 XLA parameter.
        lowest = torch.full((), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask_bias = mask_bias.masked_fill(~allowed, lowest)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask_bias)
        return self.model.norm(x)


class LoopedTextEncoder(QwenTextEncoder):
    """QwenTextEncoder with its decoder layers stacked and run by scan (qic.models.looped): same forward and
    outputs.

    state_dict: `model.embed_tokens.weight`, `model.norm.weight` + `model.layers.stacked.<layer-local name>`.
    Convert with `stack_block_weights(sd, "model.layers", L)`.
    """

    def __init__(self, config: TextEncoderConfig, tp_size: int = 1):
        super().__init__(dataclasses.replace(config, num_layers=0), tp_size)
        self.config = config
        template = template_layer(QwenTextEncoder, config, tp_size, lambda m: m.model.layers)
        self.model.layers = StackedLayers(template, config.num_layers, num_carry=1)
