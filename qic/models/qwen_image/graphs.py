"""Qwen-Image's graph makers: which graphs its components' bundles hold, their eager modules and example inputs.

- text_encoder@L:        ids [1, L], mask [1, L]                     -> hidden [1, L, D]
- denoiser@HxW@L:        one whole denoise step, cond+uncond batched -> next latents [1, S, C]; with
  exact-length text (L0) and one image on one device, text_embeds [1, Lc, J] and negative_embeds [1, Lu, J] at
  their own lengths instead of text rows [2, L, J] and their mask (packed_cfg)
- vae_decoder@HxW:       packed latents [1, S, C]                    -> image [1, 3, H, W] in [-1, 1]
- denoiser@HxW@L@head, @rest, @mixed@R1, @mid@R1 (batches), @tail: the step in parts for step caching (build
  config `step_cache`),
  inputs and outputs in step_part_graph below; the whole-step graph stays beside them.

Editing (a build with condition sizes, `--condition-size HxW`: the Edit Plus models), the images forms:
- vision@HxW (condition size, VAE side): pixels [3, gh*p, gw*p], the normalised image at the vision grid the
  pipeline gives an image of that aspect (qic.models.qwen_image.host.conditions.vision_grid_of)
                                                            -> image_embeds [gh*gw/merge^2, hidden]
- vae_encoder@HxW:       pixels [1, 3, H, W] in [-1, 1]    -> condition latents [1, (H/16)(W/16), C], normalised
  (and, img2img / inpaint at each output resolution, vae_encoder@HxW@sample: pixels and noise [1, z, H/8, W/8]
  -> a posterior sample, normalised and packed)
- text_encoder@L@images: input_ids, attention_mask [1, L + slots], mRoPE position_ids [3, L + slots],
                         image_embeds [slots, hidden]       -> hidden [1, L + slots, D]
- denoiser@HxW@L@images: the step with the text rows [2, T, J] (T = L + slots - 64, the edit template's drop),
                         condition [1, K, C], condition_mask [1, K], and its RoPE tables [T + S + K, head_dim/2]
                         as inputs (the host's: they depend on the request's condition grids) -> next latents [1, S, C]
slots: the vision tokens of --condition-images images of the largest condition size; K: their latent tokens.

Batched graphs (build config `batch_sizes`) carry `@B<n>` and take n images where the above take 1:
ids/mask [n, L]; latents [n, S, C] with text [2n, L, D] (n prompts, then their n negative prompts) and
guidance [n]; image [n, 3, H, W]. Batch 1 keeps the names, shapes and spec keys it always had.

L is a text bucket: a text-encoder length, template included; the denoiser sees L - DROP_TOKENS.
With exact-length builds (bucket 0) L is a dynamic dimension instead of a fixed size.
Input and output names recorded here are the runtime's contract with each graph.
"""

from __future__ import annotations

import torch
from torch import nn

from qic.builder.graphs import PLAIN, GraphDef
from qic.dtypes import TORCH_DTYPES
from qic.graph_names import graph_name
from qic.host.latents import packed_grid
from qic.host.prompt import DROP_TOKENS, EDIT_DROP_TOKENS, MAX_PROMPT_TOKENS
from qic.models.common import patchify
from qic.models.qwen_image.mmdit import rope_tables
from qic.models.qwen_image.step import DenoiseStep
from qic.models.qwen_image.step_cache import StepHead, StepMiddle, StepMixed, StepRest, StepTail
from qic.models.qwen_image.ulysses import padded, ulysses_shard
from qic.models.qwen_image.vae_decoder import QwenVAEDecoder
from qic.models.qwen_image.vae_encoder import QwenVAEEncoder
from qic.parallel.mesh import Layout
from qic.parallel.sequence import apply_layout, cfg_gather


class StepGraph(nn.Module):
    """DenoiseStep with its RoPE tables held as buffers computed at build time for one resolution.

    Text positions come first ([text | image]); the text part is tabulated for the longest text this
    graph can see and sliced to the actual length, so exact-length (dynamic) graphs work too.
    """

    def __init__(self, step: DenoiseStep, config, rows: int, cols: int, max_text: int, names: list[str]):
        super().__init__()
        self.step, self.names = step, names   # names: the positional graph inputs, in order
        cos, sin = rope_tables(config, rows, cols, max_text)
        self.register_buffer("rope_cos_txt", cos[:max_text].contiguous(), persistent=False)
        self.register_buffer("rope_sin_txt", sin[:max_text].contiguous(), persistent=False)
        self.register_buffer("rope_cos_img", cos[max_text:].contiguous(), persistent=False)
        self.register_buffer("rope_sin_img", sin[max_text:].contiguous(), persistent=False)

    def forward(self, *args):
        x = dict(zip(self.names, args))
        x["rope_cos"], x["rope_sin"] = self.tables(x["text_embeds"].shape[1])
        if "negative_embeds" in x:   # packed CFG: the uncond branch's text has a length of its own, none is padded
            x["neg_rope_cos"], x["neg_rope_sin"] = self.tables(x["negative_embeds"].shape[1])
            x["text_mask"] = None
        return self.step(**({"guidance": None} | x))

    def tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) over [n text tokens | image]."""
        return (torch.cat([self.rope_cos_txt[:n], self.rope_cos_img], 0),
                torch.cat([self.rope_sin_txt[:n], self.rope_sin_img], 0))


class EditStepGraph(nn.Module):
    """DenoiseStep over [noise | condition] tokens, its RoPE tables given by the host per request (the condition
    grids move the text's positions): inputs by name, `names` orders the positional graph inputs."""

    def __init__(self, step: DenoiseStep, names: list[str]):
        super().__init__()
        self.step, self.names = step, names

    def forward(self, *args):
        return self.step(**({"guidance": None} | dict(zip(self.names, args))))


class VisionGraph(nn.Module):
    """The vision tower over one grid, patchifying in the graph (reshapes only), so the host hands it the
    normalised image and the temporal repeat of a still image never crosses into the graph. The grid's window
    order, RoPE tables and window mask are buffers made at build time."""

    TABLES = ("patches", "rope_cos", "rope_sin", "window_mask", "back")

    def __init__(self, model, grid: tuple[int, int]):
        super().__init__()
        self.model, self.grid = model, grid
        for name, table in zip(self.TABLES, model.tables(*grid, torch.device("cpu"))):
            self.register_buffer(name, table, persistent=False)

    def forward(self, pixels):
        tables = tuple(getattr(self, n) for n in self.TABLES)
        return self.model(patchify(pixels, self.model.config), self.grid, tables)


class StepPartGraph(nn.Module):
    """A step-caching part (qic/models/qwen_image/step_cache.py) with its RoPE tables as build-time buffers, like
    StepGraph. Its inputs vary with the part (and CFG, and whether a tail runs blocks), so they are given by
    name: `names` orders the positional graph inputs."""

    def __init__(self, part: nn.Module, names: list[str], config, rows: int, cols: int, max_text: int):
        super().__init__()
        self.part, self.names = part, names
        cos, sin = rope_tables(config, rows, cols, max_text)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_text = max_text

    def forward(self, *args):
        x = dict(zip(self.names, args))
        if "text_mask" in x:
            n, m = x["text_mask"].shape[1], self.max_text
            x["rope_cos"] = torch.cat([self.rope_cos[:n], self.rope_cos[m:]], 0)
            x["rope_sin"] = torch.cat([self.rope_sin[:n], self.rope_sin[m:]], 0)
        return self.part(**x)


def step_part_graph(mmdit, config, vae_scale: int, height: int, width: int, bucket: int, dtype: str,
                    part: str, first: int, last: int, cfg: bool = True, batch: int = 1,
                    rows: int | None = None, layout: Layout = PLAIN) -> GraphDef:
    """One part of the step for step caching. R = text rows (2 x batch with CFG), S image tokens, D inner dim:
    - head: latents [B, S, C], text_embeds [R, L, J], text_mask [R, L], timestep, prev_residual [R, S, D]
            -> img, txt, temb, residual, diff [R] fp32
    - mid:  img [r, S, D], txt [r, L, D], temb [r, D], text_mask [r, L] (r = R, or `rows`)
            -> img, txt, img_residual, txt_residual
    - tail: latents, img_base [R, S, D], img_residual, temb, sigma, sigma_next, [guidance],
            [text_mask, txt_base, txt_residual when last > 0] -> latents
    - rest: img, txt, temb, text_mask as mid's (r = R), latents, sigma, sigma_next, [guidance]
            -> latents, img_residual, txt_residual (mid then tail, for a step whose rows all compute)
    - mixed: img, txt, temb, text_mask over the R rows, latents, img_stored [R, S, D], row [1], sigma, sigma_next,
            [guidance], [txt_stored when last > 0] -> latents, and the row's img_residual, txt_residual (the
            middle over that row, then the tail over all: a step whose rows decide apart, one computing)
    A layout (qic/models/qwen_image/step_cache.py): under CFG-parallel R is one branch's rows (the head still
    takes every text row, and cfg_rank); under Ulysses S and L are this rank's chunks of the padded streams (the
    text mask stays whole), and every part takes sp_rank. Both rank inputs last, filled by the runtime.
    """
    grid_rows, grid_cols = packed_grid(height, width, vae_scale)
    tokens = grid_rows * grid_cols
    text_len = (bucket - DROP_TOKENS) if bucket else MAX_PROMPT_TOKENS
    example_len = text_len if bucket else 8
    dt = TORCH_DTYPES[dtype]
    split = layout.cfg > 1 and cfg                      # CFG-parallel: this rank's branch rows only
    all_rows = 2 * batch if cfg else batch
    n_rows = rows or (batch if split else all_rows)
    dim = config.inner_dim
    u = layout.ulysses                                   # Ulysses: this rank's chunk of each padded stream
    local_tokens, local_text = padded(tokens, u) // u, padded(example_len, u) // u
    ranked = dict(shard=ulysses_shard(layout), tokens=tokens)

    def scalar(value):
        return torch.tensor(value, dtype=torch.float32)

    def act(n, *shape):  # activations: ones, so that an executed check (XLA) never divides by a zero mean
        return torch.ones(n, *shape, dtype=dt)

    text_mask = ("text_mask", torch.ones(n_rows, example_len, dtype=torch.long))
    rank_in = [("sp_rank", torch.zeros(1, dtype=torch.long))] if u > 1 else []
    guidance = [("guidance", scalar(4.0) if batch == 1 else torch.full((batch,), 4.0))] if cfg else []
    if part == "head":
        module = StepHead(mmdit, first, cfg, cfg_parallel=split, **ranked)
        inputs = [("latents", act(batch, tokens, config.in_channels)),
                  ("text_embeds", act(all_rows, example_len, config.joint_attention_dim)),
                  ("text_mask", torch.ones(all_rows, example_len, dtype=torch.long)),
                  ("timestep", scalar(500.0)), ("prev_residual", act(n_rows, local_tokens, dim))]
        rank_in = ([("cfg_rank", torch.zeros(1, dtype=torch.long))] if split else []) + rank_in
        outputs = ["img", "txt", "temb", "residual", "diff"]
        text_inputs = ("text_embeds", "text_mask")
    elif part == "mid":
        module = StepMiddle(mmdit, first, last, **ranked)
        inputs = [("img", act(n_rows, local_tokens, dim)), ("txt", act(n_rows, local_text, dim)),
                  ("temb", act(n_rows, dim)), text_mask]
        outputs = ["img", "txt", "img_residual", "txt_residual"]
        text_inputs = ("txt", "text_mask")
    elif part == "rest":
        module = StepRest(mmdit, first, last, cfg, cfg_gather=cfg_gather(layout), **ranked)
        inputs = [("img", act(n_rows, local_tokens, dim)), ("txt", act(n_rows, local_text, dim)),
                  ("temb", act(n_rows, dim)), text_mask, ("latents", act(batch, tokens, config.in_channels)),
                  ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4))] + guidance
        outputs = ["latents", "img_residual", "txt_residual"]
        text_inputs = ("txt", "text_mask")
    elif part == "mixed":   # takes every local row (`rows`, 1, names the middle's); runs the middle over one
        every = batch if split else all_rows
        module = StepMixed(mmdit, first, last, cfg, cfg_gather=cfg_gather(layout), **ranked)
        inputs = [("img", act(every, local_tokens, dim)), ("txt", act(every, local_text, dim)),
                  ("temb", act(every, dim)), ("text_mask", torch.ones(every, example_len, dtype=torch.long)),
                  ("latents", act(batch, tokens, config.in_channels)), ("img_stored", act(every, local_tokens, dim)),
                  ("row", torch.zeros(1, dtype=torch.long)), ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4))]
        inputs += guidance + ([("txt_stored", act(every, local_text, dim))] if last else [])
        outputs = ["latents", "img_residual", "txt_residual"]
        text_inputs = ("txt", "text_mask", "txt_stored")
    elif part == "tail":
        module = StepTail(mmdit, last, cfg, cfg_gather=cfg_gather(layout), **ranked)
        inputs = [("latents", act(batch, tokens, config.in_channels)), ("img_base", act(n_rows, local_tokens, dim)),
                  ("img_residual", act(n_rows, local_tokens, dim)), ("temb", act(n_rows, dim)),
                  ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4))] + guidance
        if last:
            inputs += [text_mask, ("txt_base", act(n_rows, local_text, dim)),
                       ("txt_residual", act(n_rows, local_text, dim))]
        outputs = ["latents"]
        text_inputs = ("text_mask", "txt_base", "txt_residual")
    else:
        raise ValueError(f"unknown step part {part!r}")
    if not layout.plain:
        apply_layout(module, layout)
    inputs += rank_in
    names = [n for n, _ in inputs]
    dynamic = None
    if not bucket:
        text = torch.export.Dim("text", min=1, max=MAX_PROMPT_TOKENS)
        dynamic = {n: ({1: text} if n in text_inputs else None) for n in names}
    shape = ({"resolution": [height, width], "bucket": bucket} | ({} if cfg else {"cfg": False})
             | {"part": part, "first": first, "last": last} | ({"rows": rows} if rows else {}) | _batch_shape(batch))
    wrapped = StepPartGraph(module, names, config, grid_rows, grid_cols, text_len)
    return GraphDef(graph_name("denoiser", (height, width), bucket, cfg, batch, part, rows), "denoiser", wrapped,
                    inputs, outputs, dynamic=dynamic, shape=shape, weight_prefix="part.mmdit.")


def _batch_shape(batch: int) -> dict:
    return {"batch": batch} if batch != 1 else {}   # batch 1: the shape (and spec key) it always had


IMAGES = "images"   # the editing forms' part: text_encoder@L<b>@images, denoiser@HxW@L<b>[@nocfg]@images


def text_encoder_images_graph(module, bucket: int, slots: int, dtype: str) -> GraphDef:
    """text_encoder@L<b>@images over b + slots tokens: the condition images' features written over the valid
    <|image_pad|> tokens (zero rows past the request's own), mRoPE positions from the host."""
    n, hidden = bucket + slots, module.config.hidden_size
    inputs = [("input_ids", torch.zeros(1, n, dtype=torch.long)),
              ("attention_mask", torch.ones(1, n, dtype=torch.long)),
              ("position_ids", torch.arange(n)[None].expand(3, n).clone()),
              ("image_embeds", torch.zeros(slots, hidden, dtype=TORCH_DTYPES[dtype]))]
    return GraphDef(graph_name("text_encoder", bucket=bucket, part=IMAGES), "text_encoder", module, inputs,
                    ["hidden_states"], shape={"bucket": bucket, "part": IMAGES, "slots": slots})


def denoiser_images_graph(mmdit, config, vae_scale: int, height: int, width: int, bucket: int, dtype: str,
                          slots: int, cond_tokens: int, cfg: bool = True, layout: Layout = PLAIN) -> GraphDef:
    """denoiser@HxW@L<b>[@nocfg]@images: one step over [noise | condition] tokens, batch 1. Text rows T =
    b + slots - EDIT_DROP_TOKENS (the image tokens' hidden states are text rows to the denoiser), `cond_tokens` = K,
    the condition latents' capacity. Under CFG-parallel each rank's transformer runs its branch (cfg_rank)."""
    if layout.ulysses > 1:
        raise ValueError("condition tokens under Ulysses are not implemented")
    rows, cols = packed_grid(height, width, vae_scale)
    text_len = bucket + slots - EDIT_DROP_TOKENS
    step = DenoiseStep(mmdit, cfg=cfg, cfg_gather=cfg_gather(layout))
    if not layout.plain:
        apply_layout(step, layout)
    dt = TORCH_DTYPES[dtype]
    n_text = 2 if cfg else 1
    half = config.attention_head_dim // 2

    def scalar(value):
        return torch.tensor(value, dtype=torch.float32)

    table = text_len + rows * cols + cond_tokens   # RoPE rows: [text | noise | conditions], fp32 as diffusers'
    inputs = [
        ("latents", torch.zeros(1, rows * cols, config.in_channels, dtype=dt)),
        ("text_embeds", torch.zeros(n_text, text_len, config.joint_attention_dim, dtype=dt)),
        ("text_mask", torch.ones(n_text, text_len, dtype=torch.long)),
        ("timestep", scalar(500.0)), ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4)),
    ] + ([("guidance", scalar(4.0))] if cfg else []) + [
        ("condition", torch.zeros(1, cond_tokens, config.in_channels, dtype=dt)),
        ("condition_mask", torch.ones(1, cond_tokens, dtype=torch.long)),
        ("rope_cos", torch.ones(table, half)), ("rope_sin", torch.ones(table, half)),
    ]
    inputs += [(name, torch.zeros(1, dtype=torch.long)) for name in rank_inputs(step)]
    module = EditStepGraph(step, [n for n, _ in inputs])
    shape = ({"resolution": [height, width], "bucket": bucket} | ({} if cfg else {"cfg": False})
             | {"part": IMAGES, "slots": slots, "cond_tokens": cond_tokens})
    return GraphDef(graph_name("denoiser", (height, width), bucket, cfg, part=IMAGES), "denoiser", module, inputs,
                    ["latents"], shape=shape, weight_prefix="step.mmdit.")


def vision_graph(module, height: int, width: int, grid: tuple[int, int], dtype: str) -> GraphDef:
    """vision@HxW: the tower over the vision grid (patches) an image of condition size HxW's aspect gets."""
    p = module.config.patch_size
    pixels = torch.zeros(3, grid[0] * p, grid[1] * p, dtype=TORCH_DTYPES[dtype])
    return GraphDef(graph_name("vision", (height, width)), "vision", VisionGraph(module, grid), [("pixels", pixels)],
                    ["image_embeds"], shape={"resolution": [height, width], "grid": list(grid)},
                    weight_prefix="model.")


SAMPLE = "sample"   # img2img's VAE encoder form: vae_encoder@HxW@sample


def vae_encoder_graph(weights_module, height: int, width: int, sample: bool = False) -> GraphDef:
    """vae_encoder@HxW: the posterior's mode (condition images); @sample: a posterior sample given its standard
    normal noise [1, z, H/sf, W/sf] (img2img and inpaint at an output size). One module per size, sharing the bound
    weights (as the decoder's per resolution)."""
    module = QwenVAEEncoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    inputs = [("pixels", torch.zeros(1, 3, height, width))]
    if sample:
        sf = module.config.scale_factor
        inputs.append(("noise", torch.zeros(1, module.config.z_dim, height // sf, width // sf)))
    return GraphDef(graph_name("vae_encoder", (height, width), part=SAMPLE if sample else None), "vae_encoder",
                    module, inputs, ["latents"],
                    shape={"resolution": [height, width]} | ({"part": SAMPLE} if sample else {}))


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
                   cfg: bool = True, batch: int = 1, layout: Layout = PLAIN) -> GraphDef:
    """cfg=False: the no-CFG step, text of batch `batch` and no guidance input (one transformer call a step).
    batch > 1: `batch` images a step, guidance [batch] (one scale per image).
    layout: Ulysses and CFG-parallel (qic/parallel/mesh.py) add the rank inputs sp_rank / cfg_rank, [1] int64,
    which the runtime fills with the rank's mesh coordinates; the graph's collectives name the mesh's axes."""
    rows, cols = packed_grid(height, width, vae_scale)
    text_len = (bucket - DROP_TOKENS) if bucket else MAX_PROMPT_TOKENS
    step = DenoiseStep(mmdit, cfg=cfg, shard=ulysses_shard(layout), cfg_gather=cfg_gather(layout))
    if not layout.plain:
        apply_layout(step, layout)
    rows_of_text = 2 * batch if cfg else batch
    example_len = text_len if bucket else 8
    dt = TORCH_DTYPES[dtype]
    packed = packed_cfg(bucket, cfg, batch, layout)

    def scalar(value):  # distinct tensors: export would treat one object passed twice as one input
        return torch.tensor(value, dtype=torch.float32)

    def text(rows, length):
        return torch.zeros(rows, length, config.joint_attention_dim, dtype=dt)

    if packed:   # each branch's text at its own length (examples of unequal lengths: two free dimensions)
        texts = [("text_embeds", text(1, example_len)), ("negative_embeds", text(1, example_len - 2))]
    else:
        texts = [("text_embeds", text(rows_of_text, example_len)),
                 ("text_mask", torch.ones(rows_of_text, example_len, dtype=torch.long))]
    inputs = [("latents", torch.zeros(batch, rows * cols, config.in_channels, dtype=dt)), *texts,
              ("timestep", scalar(500.0)), ("sigma", scalar(0.5)), ("sigma_next", scalar(0.4))]
    inputs += [("guidance", scalar(4.0) if batch == 1 else torch.full((batch,), 4.0))] if cfg else []
    inputs += [(name, torch.zeros(1, dtype=torch.long)) for name in rank_inputs(step)]
    module = StepGraph(step, config, rows, cols, text_len, [n for n, _ in inputs])
    dynamic = None
    if not bucket:
        dim = torch.export.Dim("text", min=1, max=MAX_PROMPT_TOKENS)
        dynamic = {name: None for name, _ in inputs} | {name: {1: dim} for name, _ in texts}
        if packed:
            dynamic["negative_embeds"] = {1: torch.export.Dim("negative", min=1, max=MAX_PROMPT_TOKENS)}
    shape = {"resolution": [height, width], "bucket": bucket} | ({} if cfg else {"cfg": False}) | _batch_shape(batch)
    return GraphDef(graph_name("denoiser", (height, width), bucket, cfg, batch), "denoiser", module, inputs,
                    ["latents"], dynamic=dynamic, shape=shape, weight_prefix="step.mmdit.")


def packed_cfg(bucket: int, cfg: bool, batch: int, layout: Layout) -> bool:
    """Whether the step graph takes CFG's two branches' text packed at their own lengths (DenoiseStep.packed):
    exact-length text, one image, both branches on one device. Padding the shorter branch to the longer one's
    length (the [2, L] form with a mask) computed, at 128x128 with a 123- and a 54-token prompt, 144 GFLOP a real-
    width depth-2 step where the two prompts' own lengths need 111 (docs/benchmarks.md, Per image)."""
    return not bucket and cfg and batch == 1 and layout.cfg == 1 and layout.ulysses == 1


def vae_decoder_graph(weights_module, height: int, width: int, batch: int = 1) -> GraphDef:
    # The decoder unpacks a static latent grid: one module per resolution, sharing the bound weights.
    module = QwenVAEDecoder(weights_module.config, height, width)
    module.load_state_dict(weights_module.state_dict(), strict=True, assign=True)
    rows, cols = packed_grid(height, width, module.config.scale_factor)
    latents = torch.zeros(batch, rows * cols, 4 * module.config.z_dim, dtype=torch.float32)
    return GraphDef(graph_name("vae_decoder", (height, width), batch=batch), "vae_decoder", module,
                    [("latents", latents)], ["image"], shape={"resolution": [height, width]} | _batch_shape(batch))


def rank_inputs(step: DenoiseStep) -> list[str]:
    """The mesh coordinates a step graph takes as inputs (the runtime's contract: qic.parallel.mesh.RANK_INPUTS)."""
    return (["cfg_rank"] if step.cfg_parallel else []) + (["sp_rank"] if step.shard is not None else [])
