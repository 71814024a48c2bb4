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
                    shape={"resolution": [height, width], "bucket": bucket, "part": part}, weight_prefix="model.")


def vae_decoder_graph(weights_module, height: int, width: int) -> GraphDef:
    # Unpacking needs the latent grid statically: one module per resolution, sharing the bound weights.
    module = QwenImage21VAEDecoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    tokens = torch.zeros(1, (height // VAE_SCALE) * (width // VAE_SCALE), module.config.z_dim)
    return GraphDef(graph_name("vae_decoder", (height, width)), "vae_decoder", module, [("tokens", tokens)],
                    ["image"], shape={"resolution": [height, width]})
