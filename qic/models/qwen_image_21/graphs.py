"""Qwen-Image-2.1's graph makers: the graphs its bundles hold and their inputs (the runtime's contract).

- text_encoder@L<b>:               input_ids [1, b], attention_mask [1, b] int64 -> hidden [1, b, hidden]
  (the whole bucket, system tokens included: the host drops them, so the graph does not depend on a tokenizer)
- denoiser@HxW@L<b>@prefill:       text [1, b, ctx], target [1, N, C], timestep [1], index [b], block_ids [b],
  key_valid [1, b] int64, rope_cos / rope_sin [b + N, head_dim / 2]
                                   -> prediction [1, N, C], k, v [layers, 1, heads, b, head_dim]
- denoiser@HxW@L<b>@decode:        target, timestep, k, v, key_valid, rope_cos / rope_sin [N, head_dim / 2]
                                   -> prediction [1, N, C]
- vae_decoder@HxW:                 tokens [1, N, z] (normalised) -> image [1, 4, H, W] in [-1, 1] (RGBA)

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
from qic.models.qwen_image_21.host.sampling import VAE_SCALE
from qic.models.qwen_image_21.vae import QwenImage21VAEDecoder

PREFILL, DECODE = "prefill", "decode"


class PrefillGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, text, target, timestep, index, block_ids, key_valid, rope_cos, rope_sin):
        return self.model.prefill(text, None, target, timestep, index, block_ids, key_valid != 0, rope_cos, rope_sin)


class DecodeGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, target, timestep, k, v, key_valid, rope_cos, rope_sin):
        return self.model.decode(target, timestep, k, v, key_valid != 0, rope_cos, rope_sin)


def text_encoder_graph(module, bucket: int) -> GraphDef:
    ids = torch.zeros(1, bucket, dtype=torch.long)
    mask = torch.ones(1, bucket, dtype=torch.long)
    return GraphDef(graph_name("text_encoder", bucket=bucket), "text_encoder", module,
                    [("input_ids", ids), ("attention_mask", mask)], ["hidden_states"], shape={"bucket": bucket})


def denoiser_graph(model, config, height: int, width: int, bucket: int, part: str, dtype: str) -> GraphDef:
    tokens = (height // VAE_SCALE) * (width // VAE_SCALE)
    dt = TORCH_DTYPES[dtype]
    half = config.attention_head_dim // 2
    heads = config.num_attention_heads // model.tp_size   # this rank's

    def act(*shape):
        return torch.ones(*shape, dtype=dt)

    def rope(n):   # RoPE tables stay fp32 whatever the model dtype (diffusers' fp32 angles)
        return torch.ones(n, half, dtype=torch.float32)

    step = [("target", act(1, tokens, config.in_features)), ("timestep", torch.full((1,), 0.5))]
    valid = ("key_valid", torch.ones(1, bucket, dtype=torch.long))
    if part == PREFILL:
        module = PrefillGraph(model)
        inputs = [("text", act(1, bucket, config.context_in_dim)), *step,
                  ("index", torch.arange(bucket)), ("block_ids", torch.full((bucket,), -1, dtype=torch.long)),
                  valid, ("rope_cos", rope(bucket + tokens)), ("rope_sin", rope(bucket + tokens))]
        outputs = ["prediction", "k", "v"]
    elif part == DECODE:
        module = DecodeGraph(model)
        cache = (config.num_layers, 1, heads, bucket, config.attention_head_dim)
        inputs = [*step, ("k", act(*cache)), ("v", act(*cache)), valid,
                  ("rope_cos", rope(tokens)), ("rope_sin", rope(tokens))]
        outputs = ["prediction"]
    else:
        raise ValueError(f"unknown denoiser graph {part!r}")
    return GraphDef(graph_name("denoiser", (height, width), bucket, part=part), "denoiser", module, inputs, outputs,
                    shape={"resolution": [height, width], "bucket": bucket, "part": part}, weight_prefix="model.",
                    sample=lambda: denoiser_sample(config, inputs, (height // VAE_SCALE, width // VAE_SCALE), bucket))


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


def denoiser_sample(config, inputs: list, grid: tuple[int, int], bucket: int) -> list:
    """The XLA:CPU check's inputs for a prefill or decode graph (GraphDef.sample), seeded: random text rows,
    latents and prefix K/V, and the sequence tensors a real request of a prompt 3/4 of the bucket long gets
    (qic.models.qwen_image_21.host.sequence): gather indices in range, the padded tail's keys masked, RoPE
    tables of those positions. Random indices or masks would read out of range or leave no key to attend to."""
    from qic.models.qwen_image_21.host.sequence import TEXT, JointSequence, prefix_inputs, rope_tables
    gen = torch.Generator().manual_seed(0)
    seq = JointSequence(((TEXT, max(1, 3 * bucket // 4)),), grid)
    index, block_ids, key_valid = prefix_inputs(seq, bucket, bucket)
    cos, sin = rope_tables(config.axes_dims_rope, seq, bucket)
    decode = "k" in dict(inputs)
    fixed = {"timestep": torch.full((1,), CHECK_TIMESTEP), "index": index, "block_ids": block_ids,
             "key_valid": key_valid.long(), "rope_cos": cos[bucket:] if decode else cos,
             "rope_sin": sin[bucket:] if decode else sin}
    return [(name, fixed[name] if name in fixed else torch.randn(t.shape, generator=gen).to(t.dtype))
            for name, t in inputs]


def vae_decoder_graph(weights_module, height: int, width: int) -> GraphDef:
    # Unpacking needs the latent grid statically: one module per resolution, sharing the bound weights.
    module = QwenImage21VAEDecoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    tokens = torch.zeros(1, (height // VAE_SCALE) * (width // VAE_SCALE), module.config.z_dim)
    return GraphDef(graph_name("vae_decoder", (height, width)), "vae_decoder", module, [("tokens", tokens)],
                    ["image"], shape={"resolution": [height, width]})
