"""Stage 2's graph definitions: which graphs a bundle holds, their eager modules and example inputs.

- text_encoder@L:        ids [1, L], mask [1, L]                     -> hidden [1, L, D]
- denoiser@HxW@L:        one whole denoise step, cond+uncond batched -> next latents [1, S, C]
- vae_decoder@HxW:       packed latents [1, S, C]                    -> image [1, 3, H, W] in [-1, 1]

Batched graphs (build config `batch_sizes`) carry `@B<n>` and take n images where the above take 1:
ids/mask [n, L]; latents [n, S, C] with text [2n, L, D] (n prompts, then their n negative prompts) and
guidance [n]; image [n, 3, H, W]. Batch 1 keeps the names, shapes and spec keys it always had.

L is a text bucket: a text-encoder length, template included; the denoiser sees L - DROP_TOKENS.
With exact-length builds (bucket 0) L is a dynamic dimension instead of a fixed size.
Input and output names recorded here are the runtime's contract with each graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qic.dtypes import TORCH_DTYPES
from qic.graph_names import graph_name
from qic.host.latents import packed_grid
from qic.host.prompt import DROP_TOKENS, MAX_PROMPT_TOKENS
from qic.models.mmdit import rope_tables
from qic.models.step import DenoiseStep
from qic.models.vae_decoder import QwenVAEDecoder


@dataclass
class GraphDef:
    name: str                      # e.g. "denoiser@48x80@L128"
    component: str
    module: nn.Module              # weights bound (memory-mapped) before export
    inputs: list[tuple[str, torch.Tensor]]
    outputs: list[str]
    dynamic: dict | None = None    # torch.export dynamic_shapes, for exact-length text
    weight_prefix: str = ""        # graph constant name = prefix + weight-shard tensor name
    shape: dict = field(default_factory=dict)  # what the runtime selects on: resolution, bucket


class StepGraph(nn.Module):
    """DenoiseStep with its RoPE tables held as buffers computed at build time for one resolution.

    Text positions come first ([text | image]); the text part is tabulated for the longest text this
    graph can see and sliced to the actual length, so exact-length (dynamic) graphs work too.
    """

    def __init__(self, step: DenoiseStep, config, rows: int, cols: int, max_text: int):
        super().__init__()
        self.step = step
        cos, sin = rope_tables(config, rows, cols, max_text)
        self.register_buffer("rope_cos_txt", cos[:max_text].contiguous(), persistent=False)
        self.register_buffer("rope_sin_txt", sin[:max_text].contiguous(), persistent=False)
        self.register_buffer("rope_cos_img", cos[max_text:].contiguous(), persistent=False)
        self.register_buffer("rope_sin_img", sin[max_text:].contiguous(), persistent=False)

    def forward(self, latents, text_embeds, text_mask, timestep, sigma, sigma_next, guidance=None):
        n = text_embeds.shape[1]
        cos = torch.cat([self.rope_cos_txt[:n], self.rope_cos_img], 0)
        sin = torch.cat([self.rope_sin_txt[:n], self.rope_sin_img], 0)
        return self.step(latents, text_embeds, text_mask, timestep, sigma, sigma_next, guidance, cos, sin)


def _batch_shape(batch: int) -> dict:
    return {"batch": batch} if batch != 1 else {}   # batch 1: the shape (and spec key) it always had


def text_encoder_graph(module, bucket: int, batch: int = 1) -> GraphDef:
    length = bucket or DROP_TOKENS + 8
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.ones(batch, length, dtype=torch.long)
    dynamic = None
    if not bucket:
        text = torch.export.Dim("text", min=DROP_TOKENS + 1, max=DROP_TOKENS + MAX_PROMPT_TOKENS)
        dynamic = {"input_ids": {1: text}, "attention_mask": {1: text}}
    return GraphDef(graph_name("text_encoder", bucket=bucket, batch=batch), "text_encoder", module,
                    [("input_ids", ids), ("attention_mask", mask)], ["hidden_states"], dynamic=dynamic,
                    shape={"bucket": bucket} | _batch_shape(batch))


def denoiser_graph(mmdit, config, vae_scale: int, height: int, width: int, bucket: int, dtype: str,
                   cfg: bool = True, batch: int = 1) -> GraphDef:
    """cfg=False: the no-CFG step, text of batch `batch` and no guidance input (one transformer call a step).
    batch > 1: `batch` images a step, guidance [batch] (one scale per image)."""
    rows, cols = packed_grid(height, width, vae_scale)
    text_len = (bucket - DROP_TOKENS) if bucket else MAX_PROMPT_TOKENS
    module = StepGraph(DenoiseStep(mmdit, cfg=cfg), config, rows, cols, text_len)
    rows_of_text = 2 * batch if cfg else batch
    example_len = text_len if bucket else 8
    dt = TORCH_DTYPES[dtype]

    def scalar(value):  # distinct tensors: export would treat one object passed twice as one input
        return torch.tensor(value, dtype=torch.float32)

    inputs = [
        ("latents", torch.zeros(batch, rows * cols, config.in_channels, dtype=dt)),
        ("text_embeds", torch.zeros(rows_of_text, example_len, config.joint_attention_dim, dtype=dt)),
        ("text_mask", torch.ones(rows_of_text, example_len, dtype=torch.long)),
        ("timestep", scalar(500.0)), ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4)),
    ] + ([("guidance", scalar(4.0) if batch == 1 else torch.full((batch,), 4.0))] if cfg else [])
    dynamic = None
    if not bucket:
        text = torch.export.Dim("text", min=1, max=MAX_PROMPT_TOKENS)
        dynamic = {name: None for name, _ in inputs} | {"text_embeds": {1: text}, "text_mask": {1: text}}
    shape = {"resolution": [height, width], "bucket": bucket} | ({} if cfg else {"cfg": False}) | _batch_shape(batch)
    return GraphDef(graph_name("denoiser", (height, width), bucket, cfg, batch), "denoiser", module, inputs,
                    ["latents"], dynamic=dynamic, shape=shape, weight_prefix="step.mmdit.")


def vae_decoder_graph(weights_module, height: int, width: int, batch: int = 1) -> GraphDef:
    # The decoder unpacks a static latent grid: one module per resolution, sharing the bound weights.
    module = QwenVAEDecoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    rows, cols = packed_grid(height, width, module.config.scale_factor)
    latents = torch.zeros(batch, rows * cols, 4 * module.config.z_dim, dtype=torch.float32)
    return GraphDef(graph_name("vae_decoder", (height, width), batch=batch), "vae_decoder", module,
                    [("latents", latents)], ["image"], shape={"resolution": [height, width]} | _batch_shape(batch))


def make_graph(component: str, module, configs: dict, shape: dict, dtype: str):
    """The GraphDef of one graph around a component module (weights bound, or fake for estimates), by the
    shape qic.builder.jobs plans."""
    batch = shape.get("batch", 1)
    if component == "text_encoder":
        return text_encoder_graph(module, shape["bucket"], batch)
    if component == "denoiser":
        h, w = shape["resolution"]
        return denoiser_graph(module, configs["denoiser"], configs["vae_decoder"].scale_factor, h, w,
                              shape["bucket"], dtype, cfg=shape.get("cfg", True), batch=batch)
    return vae_decoder_graph(module, *shape["resolution"], batch)
