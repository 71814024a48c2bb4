"""Qwen-Image-2.1's graph makers: the graphs its bundles hold and their inputs (the runtime's contract).

- text_encoder@L<b>:               input_ids [1, b], attention_mask [1, b] int64 -> hidden [1, b, hidden]
  (the whole bucket, system tokens included: the host drops them, so the graph does not depend on a tokenizer)
- denoiser@HxW@L<b>@prefill:       text [1, b, ctx], target [1, N, C], timestep [1], index [b], block_ids [b],
  key_valid [1, b] int64, rope_cos / rope_sin [b + N, head_dim / 2]
                                   -> prediction [1, N, C], k, v [layers, 1, heads, b, head_dim]
- denoiser@HxW@L<b>@decode:        target, timestep, k, v, key_valid, rope_cos / rope_sin [N, head_dim / 2]
                                   -> prediction [1, N, C]
- vae_decoder@HxW:                 tokens [1, N, z] (normalised) -> image [1, 4, H, W] in [-1, 1] (RGBA)
- vision@HxW (condition size):     pixels [3, H', W'] (the normalised RGB copy: sampling.vision_image, then
                                   processor.vision_pixels; H', W' = the vision grid x patch)
                                   -> image_embeds [n, out], deepstack_embeds [k, n, out]
                                   (n = the grid's merged tokens = the image's slots)
- vae_encoder@HxW (condition size): pixels [1, 4, H, W] in [-1, 1] (RGBA) -> tokens [1, (H/16)(W/16), z]
  (normalised), fp32 whatever the build's dtype

Text to image only, so the prefix is the text: its bucket P equals the text bucket T = b (the encoder's rows,
the dropped system rows' worth of padding at the end, masked by key_valid). One call per CFG branch (batch 1):
each branch keeps its own prefix K/V. The per-request tensors (index, block_ids, key_valid, RoPE tables) are made
by the host from qic.models.qwen_image_21.host.sequence, so one pair of graphs serves every prompt length that fits.
"""

from __future__ import annotations

import torch
from torch import nn

from qic.builder.graphs import GraphDef
from qic.dtypes import TORCH_DTYPES
from qic.graph_names import graph_name
from qic.models.common import patchify
from qic.models.qwen_image_21.host.sampling import VAE_SCALE
from qic.models.qwen_image_21.host.sequence import prefix_sizes
from qic.models.qwen_image_21.vae import QwenImage21VAEDecoder, QwenImage21VAEEncoder

PREFILL, DECODE = "prefill", "decode"
IMAGES = "images"   # the condition-image forms: text_encoder@L<b>@images, denoiser@HxW@L<b>@{prefill,decode}-images
PREFILL_IMAGES, DECODE_IMAGES = f"{PREFILL}-{IMAGES}", f"{DECODE}-{IMAGES}"


class PrefillGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, text, target, timestep, index, block_ids, key_valid, rope_cos, rope_sin):
        return self.model.prefill(text, None, target, timestep, index, block_ids, key_valid != 0, rope_cos, rope_sin)


class PrefillImagesGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, text, cond, target, timestep, index, block_ids, key_valid, rope_cos, rope_sin):
        return self.model.prefill(text, cond, target, timestep, index, block_ids, key_valid != 0, rope_cos, rope_sin)


class DecodeGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, target, timestep, k, v, key_valid, rope_cos, rope_sin):
        return self.model.decode(target, timestep, k, v, key_valid != 0, rope_cos, rope_sin)


class VisionGraph(nn.Module):
    """The tower over one condition grid, patchifying in the graph (reshapes only), so the host hands it the
    normalised image and the temporal repeat of a still image never crosses into the graph."""

    def __init__(self, model, grid: tuple[int, int]):
        super().__init__()
        self.model, self.grid = model, grid

    def forward(self, pixels):
        return self.model(patchify(pixels, self.model.config), self.grid)


def text_encoder_graph(module, bucket: int, slots: int = 0, dtype: str = "float32") -> GraphDef:
    """text_encoder@L<b>, or with `slots` (the condition images' capacity in <|image_pad|> tokens) the images form
    text_encoder@L<b>@images over b + slots tokens: input_ids, attention_mask [1, b + slots], mRoPE position_ids
    [3, b + slots], image_embeds [slots, hidden] and deepstack_embeds [k, slots, hidden] (the vision graphs'
    outputs in prompt order, zero rows past the request's own)."""
    if not slots:
        ids = torch.zeros(1, bucket, dtype=torch.long)
        mask = torch.ones(1, bucket, dtype=torch.long)
        return GraphDef(graph_name("text_encoder", bucket=bucket), "text_encoder", module,
                        [("input_ids", ids), ("attention_mask", mask)], ["hidden_states"], shape={"bucket": bucket})
    cfg, n = module.config, bucket + slots
    dt = TORCH_DTYPES[dtype]
    inputs = [("input_ids", torch.zeros(1, n, dtype=torch.long)),
              ("attention_mask", torch.ones(1, n, dtype=torch.long)),
              ("position_ids", torch.arange(n)[None].expand(3, n).clone()),
              ("image_embeds", torch.zeros(slots, cfg.hidden_size, dtype=dt)),
              ("deepstack_embeds", torch.zeros(cfg.deepstack_layers, slots, cfg.hidden_size, dtype=dt))]
    return GraphDef(graph_name("text_encoder", bucket=bucket, part=IMAGES), "text_encoder", module, inputs,
                    ["hidden_states"], shape={"bucket": bucket, "part": IMAGES, "slots": slots})


def denoiser_graph(model, config, height: int, width: int, bucket: int, part: str, dtype: str,
                   slots: int = 0) -> GraphDef:
    """The prefill or decode graph; the -images parts take condition images up to `slots` image slots."""
    tokens = (height // VAE_SCALE) * (width // VAE_SCALE)
    text_rows, cond_rows, prefix = prefix_sizes(bucket, slots if part in (PREFILL_IMAGES, DECODE_IMAGES) else 0)
    dt = TORCH_DTYPES[dtype]
    half = config.attention_head_dim // 2
    heads = config.num_attention_heads // model.tp_size   # this rank's

    def act(*shape):
        return torch.ones(*shape, dtype=dt)

    def rope(n):   # RoPE tables stay fp32 whatever the model dtype (diffusers' fp32 angles)
        return torch.ones(n, half, dtype=torch.float32)

    step = [("target", act(1, tokens, config.in_features)), ("timestep", torch.full((1,), 0.5))]
    valid = ("key_valid", torch.ones(1, prefix, dtype=torch.long))
    if part in (PREFILL, PREFILL_IMAGES):
        module = PrefillGraph(model) if part == PREFILL else PrefillImagesGraph(model)
        cond = [("cond", act(1, cond_rows, config.in_features))] if part == PREFILL_IMAGES else []
        inputs = [("text", act(1, text_rows, config.context_in_dim)), *cond, *step,
                  ("index", torch.arange(prefix) % (text_rows + cond_rows)),
                  ("block_ids", torch.full((prefix,), -1, dtype=torch.long)),
                  valid, ("rope_cos", rope(prefix + tokens)), ("rope_sin", rope(prefix + tokens))]
        outputs = ["prediction", "k", "v"]
    elif part in (DECODE, DECODE_IMAGES):
        module = DecodeGraph(model)
        cache = (config.num_layers, 1, heads, prefix, config.attention_head_dim)
        inputs = [*step, ("k", act(*cache)), ("v", act(*cache)), valid,
                  ("rope_cos", rope(tokens)), ("rope_sin", rope(tokens))]
        outputs = ["prediction"]
    else:
        raise ValueError(f"unknown denoiser graph {part!r}")
    shape = {"resolution": [height, width], "bucket": bucket, "part": part} | ({"slots": slots} if cond_rows else {})
    return GraphDef(graph_name("denoiser", (height, width), bucket, part=part), "denoiser", module, inputs, outputs,
                    shape=shape, weight_prefix="model.",
                    sample=lambda: denoiser_sample(config, inputs, (height // VAE_SCALE, width // VAE_SCALE), bucket,
                                                   slots if cond_rows else 0))


# The check's timestep (t / 1000, as the pipeline passes it). Not 0, so the prefix (modulated at t = 0) and the
# target are modulated differently and a graph that modulated the prefix at t fails the check. Small, because the
# time embedding's angles are a_k = 1000 t f_k with f_k = exp(-ln(1e4) k / 128), k < 128, and XLA's fp32 exp
# and eager's may each be an ulp off (with the product's rounding, |da_k| <= 2 * 2^-23 * a_k); cos and sin pass
# that on absolutely. Over the 256-wide [cos | sin] vector (norm sqrt(128)) that is a relative error of at most
# 2^-22 * 1000 t * sqrt(sum_k f_k^2) / sqrt(128) = 5.8e-5 t (sum_k f_k^2 = 7.5, a geometric series), which the
# modulation passes on to the prediction at order one (random, well-conditioned projections). At t = 0.05 that
# is 2.9e-6, inside the check's fp32 bound (qic.backends.neuron.build.XLA_CPU_REL_L2, for the reductions'
# reassociation); at t = 1 it could reach 5.8e-5 and the bound would measure exp's ulps, not the lowering
# (tests/test_neuron_xla_q21.py checks the figures against 1e-5 + 5.8e-5 t at t = 0.05, 0.5 and 1).
CHECK_TIMESTEP = 0.05


def denoiser_sample(config, inputs: list, grid: tuple[int, int], bucket: int, slots: int = 0) -> list:
    """The XLA:CPU check's inputs for a prefill or decode graph (GraphDef.sample), seeded: random text rows,
    latents and prefix K/V, and the sequence tensors a real request of a prompt 3/4 of the bucket long gets
    (qic.models.qwen_image_21.host.sequence): gather indices in range, the padded tail's keys masked, RoPE
    tables of those positions. Random indices or masks would read out of range or leave no key to attend to.
    The images forms (`slots`): the prompt split around one condition image filling every slot, a block of its
    own in the mask."""
    from qic.models.qwen_image_21.host.sequence import (
        IMAGE,
        SLOT_TOKENS,
        TEXT,
        JointSequence,
        prefix_inputs,
        rope_tables,
    )
    gen = torch.Generator().manual_seed(0)
    text = max(2, 3 * bucket // 4)
    image = ((IMAGE, 2, SLOT_TOKENS * slots // 2),) if slots else ()
    seq = JointSequence(((TEXT, text // 2), *image, (TEXT, text - text // 2)), grid)
    text_rows, _, prefix = prefix_sizes(bucket, slots)
    index, block_ids, key_valid = prefix_inputs(seq, prefix, text_rows)
    cos, sin = rope_tables(config.axes_dims_rope, seq, prefix)
    decode = "k" in dict(inputs)   # its RoPE rows are the target's, after the prefix
    fixed = {"timestep": torch.full((1,), CHECK_TIMESTEP), "index": index, "block_ids": block_ids,
             "key_valid": key_valid.long(), "rope_cos": cos[prefix:] if decode else cos,
             "rope_sin": sin[prefix:] if decode else sin}
    return [(name, fixed[name] if name in fixed else torch.randn(t.shape, generator=gen).to(t.dtype))
            for name, t in inputs]


def vae_decoder_graph(weights_module, height: int, width: int) -> GraphDef:
    # Unpacking needs the latent grid statically: one module per resolution, sharing the bound weights.
    module = QwenImage21VAEDecoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    tokens = torch.zeros(1, (height // VAE_SCALE) * (width // VAE_SCALE), module.config.z_dim)
    return GraphDef(graph_name("vae_decoder", (height, width)), "vae_decoder", module, [("tokens", tokens)],
                    ["image"], shape={"resolution": [height, width]})


def condition_grid(config, height: int, width: int) -> tuple[int, int]:
    """The vision grid (patches) of a condition image at its VAE-side size: the size itself in patches, which the
    family's validate checks the processor's resize keeps (its image slots then match the latent tokens)."""
    return height // config.patch_size, width // config.patch_size


def vision_graph(module, height: int, width: int, dtype: str) -> GraphDef:
    grid = condition_grid(module.config, height, width)
    p = module.config.patch_size
    pixels = torch.zeros(3, grid[0] * p, grid[1] * p, dtype=TORCH_DTYPES[dtype])
    return GraphDef(graph_name("vision", (height, width)), "vision", VisionGraph(module, grid), [("pixels", pixels)],
                    ["image_embeds", "deepstack_embeds"], shape={"resolution": [height, width]}, weight_prefix="model.")


def vae_encoder_graph(weights_module, height: int, width: int) -> GraphDef:
    # One module per condition size, sharing the bound weights (as the decoder's per resolution).
    module = QwenImage21VAEEncoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    pixels = torch.zeros(1, 4, height, width)
    return GraphDef(graph_name("vae_encoder", (height, width)), "vae_encoder", module, [("pixels", pixels)],
                    ["tokens"], shape={"resolution": [height, width]})
