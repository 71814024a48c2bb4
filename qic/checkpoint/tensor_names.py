"""Tensor names and shapes of each Qwen-Image component, derived from its config alone.

One function per component: config dict -> ordered list of (name, shape). The names are those of the
checkpoint files on the hub (diffusers names for transformer/vae; the transformers-4.x hub layout for the
text encoder: `model.*`, `visual.*`, `lm_head.weight`). The order follows module registration order of the
reference implementations, so that a listing reads like their state_dict.

Pure Python: no torch, no diffusers/transformers. Used by the embedded checkpoint generator and usable by
checkpoint readers to say exactly which tensor is missing or misshapen.
"""

from __future__ import annotations

from collections.abc import Mapping

from qic.errors import ConfigError

Shape = tuple[int, ...]
TensorList = list[tuple[str, Shape]]


def _need(config: Mapping, key: str, component: str):
    if key not in config:
        raise ConfigError(f"{component} config lacks {key!r}")
    return config[key]


def _linear(out: list, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
    out.append((f"{name}.weight", (out_f, in_f)))
    if bias:
        out.append((f"{name}.bias", (out_f,)))


# --------------------------------------------------------------------------------------------------------
# Denoiser: diffusers QwenImageTransformer2DModel


def transformer_tensors(config: Mapping) -> TensorList:
    c = "transformer"
    heads = int(_need(config, "num_attention_heads", c))
    head_dim = int(_need(config, "attention_head_dim", c))
    inner = heads * head_dim
    in_ch = int(_need(config, "in_channels", c))
    out_ch = int(config.get("out_channels") or in_ch)
    patch = int(config.get("patch_size", 2))
    joint = int(_need(config, "joint_attention_dim", c))
    layers = int(_need(config, "num_layers", c))

    t: TensorList = []
    _linear(t, "time_text_embed.timestep_embedder.linear_1", inner, 256)
    _linear(t, "time_text_embed.timestep_embedder.linear_2", inner, inner)
    if config.get("use_additional_t_cond", False):
        t.append(("time_text_embed.addition_t_embedding.weight", (2, inner)))
    t.append(("txt_norm.weight", (joint,)))
    _linear(t, "img_in", inner, in_ch)
    _linear(t, "txt_in", inner, joint)
    for i in range(layers):
        b = f"transformer_blocks.{i}"
        _linear(t, f"{b}.img_mod.1", 6 * inner, inner)
        t.append((f"{b}.attn.norm_q.weight", (head_dim,)))
        t.append((f"{b}.attn.norm_k.weight", (head_dim,)))
        for p in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj", "add_q_proj", "to_out.0", "to_add_out"):
            _linear(t, f"{b}.attn.{p}", inner, inner)
        t.append((f"{b}.attn.norm_added_q.weight", (head_dim,)))
        t.append((f"{b}.attn.norm_added_k.weight", (head_dim,)))
        _linear(t, f"{b}.img_mlp.net.0.proj", 4 * inner, inner)
        _linear(t, f"{b}.img_mlp.net.2", inner, 4 * inner)
        _linear(t, f"{b}.txt_mod.1", 6 * inner, inner)
        _linear(t, f"{b}.txt_mlp.net.0.proj", 4 * inner, inner)
        _linear(t, f"{b}.txt_mlp.net.2", inner, 4 * inner)
    _linear(t, "norm_out.linear", 2 * inner, inner)
    _linear(t, "proj_out", patch * patch * out_ch, inner)
    return t


# --------------------------------------------------------------------------------------------------------
# VAE: diffusers AutoencoderKLQwenImage (WAN-style causal 3D)


def _conv3d(out: list, name: str, out_c: int, in_c: int, k: tuple[int, int, int]) -> None:
    out.append((f"{name}.weight", (out_c, in_c) + tuple(k)))
    out.append((f"{name}.bias", (out_c,)))


def _conv2d(out: list, name: str, out_c: int, in_c: int, k: int) -> None:
    out.append((f"{name}.weight", (out_c, in_c, k, k)))
    out.append((f"{name}.bias", (out_c,)))


def _vae_resblock(out: list, name: str, in_dim: int, out_dim: int) -> None:
    out.append((f"{name}.norm1.gamma", (in_dim, 1, 1, 1)))
    _conv3d(out, f"{name}.conv1", out_dim, in_dim, (3, 3, 3))
    out.append((f"{name}.norm2.gamma", (out_dim, 1, 1, 1)))
    _conv3d(out, f"{name}.conv2", out_dim, out_dim, (3, 3, 3))
    if in_dim != out_dim:
        _conv3d(out, f"{name}.conv_shortcut", out_dim, in_dim, (1, 1, 1))


def _vae_attention(out: list, name: str, dim: int) -> None:
    out.append((f"{name}.norm.gamma", (dim, 1, 1)))
    _conv2d(out, f"{name}.to_qkv", 3 * dim, dim, 1)
    _conv2d(out, f"{name}.proj", dim, dim, 1)


def _vae_resample(out: list, name: str, dim: int, mode: str) -> None:
    if mode in ("upsample2d", "upsample3d"):
        _conv2d(out, f"{name}.resample.1", dim // 2, dim, 3)
        if mode == "upsample3d":
            _conv3d(out, f"{name}.time_conv", dim * 2, dim, (3, 1, 1))
    elif mode in ("downsample2d", "downsample3d"):
        _conv2d(out, f"{name}.resample.1", dim, dim, 3)
        if mode == "downsample3d":
            _conv3d(out, f"{name}.time_conv", dim, dim, (3, 1, 1))
    else:  # pragma: no cover - internal
        raise ValueError(mode)


def _vae_mid(out: list, name: str, dim: int) -> None:
    # state_dict order is the reference's registration order: attentions before resnets
    _vae_attention(out, f"{name}.attentions.0", dim)
    _vae_resblock(out, f"{name}.resnets.0", dim, dim)
    _vae_resblock(out, f"{name}.resnets.1", dim, dim)


def vae_tensors(config: Mapping) -> TensorList:
    c = "vae"
    base = int(config.get("base_dim", 96))
    z_dim = int(config.get("z_dim", 16))
    dim_mult = list(config.get("dim_mult", [1, 2, 4, 4]))
    n_res = int(config.get("num_res_blocks", 2))
    attn_scales = [float(s) for s in config.get("attn_scales", [])]
    tdown = [bool(x) for x in config.get("temperal_downsample", [False, True, True])]
    in_ch = int(config.get("input_channels", 3))
    if len(tdown) != len(dim_mult) - 1:
        raise ConfigError(f"{c} config: temperal_downsample needs {len(dim_mult) - 1} entries, has {len(tdown)}")

    t: TensorList = []
    # encoder (outputs 2*z_dim: mean and log-variance)
    enc: TensorList = []
    dims = [base * u for u in [1] + dim_mult]
    _conv3d(enc, "encoder.conv_in", dims[0], in_ch, (3, 3, 3))
    k = 0
    scale = 1.0
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(n_res):
            _vae_resblock(enc, f"encoder.down_blocks.{k}", in_dim, out_dim)
            k += 1
            if scale in attn_scales:
                _vae_attention(enc, f"encoder.down_blocks.{k}", out_dim)
                k += 1
            in_dim = out_dim
        if i != len(dim_mult) - 1:
            _vae_resample(enc, f"encoder.down_blocks.{k}", out_dim, "downsample3d" if tdown[i] else "downsample2d")
            k += 1
            scale /= 2.0
    _vae_mid(enc, "encoder.mid_block", dims[-1])
    enc.append(("encoder.norm_out.gamma", (dims[-1], 1, 1, 1)))
    _conv3d(enc, "encoder.conv_out", 2 * z_dim, dims[-1], (3, 3, 3))
    t += enc

    _conv3d(t, "quant_conv", 2 * z_dim, 2 * z_dim, (1, 1, 1))
    _conv3d(t, "post_quant_conv", z_dim, z_dim, (1, 1, 1))

    # decoder (attention in the reference decoder lives only in the mid block)
    dec: TensorList = []
    tup = tdown[::-1]
    dims = [base * u for u in [dim_mult[-1]] + dim_mult[::-1]]
    _conv3d(dec, "decoder.conv_in", dims[0], z_dim, (3, 3, 3))
    _vae_mid(dec, "decoder.mid_block", dims[0])
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        if i > 0:
            in_dim = in_dim // 2
        cur = in_dim
        for j in range(n_res + 1):
            _vae_resblock(dec, f"decoder.up_blocks.{i}.resnets.{j}", cur, out_dim)
            cur = out_dim
        if i != len(dim_mult) - 1:
            _vae_resample(dec, f"decoder.up_blocks.{i}.upsamplers.0", out_dim,
                          "upsample3d" if tup[i] else "upsample2d")
    dec.append(("decoder.norm_out.gamma", (dims[-1], 1, 1, 1)))
    _conv3d(dec, "decoder.conv_out", in_ch, dims[-1], (3, 3, 3))
    t += dec
    return t


# --------------------------------------------------------------------------------------------------------
# Text encoder: Qwen2.5-VL (hub layout of transformers 4.x checkpoints)


def text_config_of(config: Mapping) -> Mapping:
    """The language-model part of a Qwen2.5-VL config: flat (hub) or nested under text_config (newer saves)."""
    tc = config.get("text_config")
    if isinstance(tc, Mapping):
        merged = dict(config)
        merged.update(tc)
        return merged
    return config


def text_encoder_tensors(config: Mapping, include_visual: bool = True) -> TensorList:
    """Hub names: `visual.*`, `model.*` (language model), `lm_head.weight` (unless tied)."""
    c = "text_encoder"
    tc = text_config_of(config)
    hidden = int(_need(tc, "hidden_size", c))
    inter = int(_need(tc, "intermediate_size", c))
    layers = int(_need(tc, "num_hidden_layers", c))
    heads = int(_need(tc, "num_attention_heads", c))
    kv = int(tc.get("num_key_value_heads") or heads)
    vocab = int(_need(tc, "vocab_size", c))
    head_dim = int(tc.get("head_dim") or hidden // heads)

    t: TensorList = []
    if include_visual:
        t += _visual_tensors(_need(config, "vision_config", c))
    t.append(("model.embed_tokens.weight", (vocab, hidden)))
    for i in range(layers):
        b = f"model.layers.{i}"
        _linear(t, f"{b}.self_attn.q_proj", heads * head_dim, hidden)
        _linear(t, f"{b}.self_attn.k_proj", kv * head_dim, hidden)
        _linear(t, f"{b}.self_attn.v_proj", kv * head_dim, hidden)
        _linear(t, f"{b}.self_attn.o_proj", hidden, heads * head_dim, bias=False)
        _linear(t, f"{b}.mlp.gate_proj", inter, hidden, bias=False)
        _linear(t, f"{b}.mlp.up_proj", inter, hidden, bias=False)
        _linear(t, f"{b}.mlp.down_proj", hidden, inter, bias=False)
        t.append((f"{b}.input_layernorm.weight", (hidden,)))
        t.append((f"{b}.post_attention_layernorm.weight", (hidden,)))
    t.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        t.append(("lm_head.weight", (vocab, hidden)))
    return t


def _visual_tensors(vc: Mapping) -> TensorList:
    c = "text_encoder vision_config"
    hidden = int(_need(vc, "hidden_size", c))
    inter = int(_need(vc, "intermediate_size", c))
    depth = int(_need(vc, "depth", c))
    in_ch = int(vc.get("in_channels", vc.get("in_chans", 3)))
    patch = int(vc.get("patch_size", 14))
    tpatch = int(vc.get("temporal_patch_size", 2))
    merge = int(vc.get("spatial_merge_size", 2))
    out_hidden = int(_need(vc, "out_hidden_size", c))

    t: TensorList = [("visual.patch_embed.proj.weight", (hidden, in_ch, tpatch, patch, patch))]
    for i in range(depth):
        b = f"visual.blocks.{i}"
        t.append((f"{b}.norm1.weight", (hidden,)))
        t.append((f"{b}.norm2.weight", (hidden,)))
        _linear(t, f"{b}.attn.qkv", 3 * hidden, hidden)
        _linear(t, f"{b}.attn.proj", hidden, hidden)
        _linear(t, f"{b}.mlp.gate_proj", inter, hidden)
        _linear(t, f"{b}.mlp.up_proj", inter, hidden)
        _linear(t, f"{b}.mlp.down_proj", hidden, inter)
    merged = hidden * merge * merge
    t.append(("visual.merger.ln_q.weight", (hidden,)))
    _linear(t, "visual.merger.mlp.0", merged, merged)
    _linear(t, "visual.merger.mlp.2", out_hidden, merged)
    return t


def hub_to_transformers5(name: str) -> str:
    """How transformers 5 renames a hub text-encoder tensor when it loads it (for comparisons)."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name


COMPONENT_TENSORS = {
    "transformer": transformer_tensors,
    "vae": vae_tensors,
    "text_encoder": text_encoder_tensors,
}
