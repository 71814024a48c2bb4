"""Qwen-Image-2.1's host program (qic.runtime.programs): host code over a bundle's graphs, as diffusers'
QwenImage21Pipeline runs text to image.

Per request: the t2i template tokenised (qic's tokenizer on the checkpoint's files), right-padded to the smallest
text bucket; the encoder graph; its rows from the dropped system tokens on (zero padding to the bucket, masked as
keys); the schedule (the checkpoint's sample_sigmas when it has them, else linspace over `steps`, shifted as the
scheduler config says: sampling.py); the pipeline's initial noise for a CPU generator of `seed`. Then per step:
on the first, the prefill graph over [text | target] for each CFG branch (true CFG when guidance > 1 and a
negative prompt is given, as the pipeline's true_cfg_scale: neg + g * (cond - neg), no renormalisation; the
negative prompt defaults to ' ' as for every family, qic.host.options; null: none), whose
prefix K/V stay resident, one per branch; on every later step the decode graph of the target against them
(kv_cache=False: the prefill at every step, the pipeline's use_kv_cache=False). The Euler update in fp32 as the
scheduler's step; the VAE decoder graph; the RGBA image as the pipeline's postprocess returns it.

Parallel layouts (the bundle's, qic.parallel.mesh): under TP every rank runs this same program, its graphs'
collectives making every rank's outputs whole. Under CFG-parallel, CFG group c encodes and denoises branch c only
(0 the prompt, 1 the negative prompt) and keeps that branch's prefix K/V; the two predictions of a step are then
exchanged on the host (mesh.from_each_branch) and every rank takes the same Euler step. A request without CFG runs
its one branch on both groups (nothing to split; no exchange).

Only host code: this package (the program, and its sampling, sequence and prompt modules) holds no nn.Module and
no model definition, so a runtime may import all of it (qic.runtime.programs); the family's model modules import
from it, never the other way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qic.errors import ConfigError
from qic.host.condition_images import ConditionedResult
from qic.host.image_tokens import IMAGE_PAD, expand_image_pads, mrope_positions
from qic.host.options import request_class
from qic.host.prompt import pick_bucket
from qic.models.qwen_image_21.host.conditions import (
    Conditions,
    condition_sizes,
    encode_conditions,
    read_images,
    vision_grids,
)
from qic.models.qwen_image_21.host.prompt import prompt_text
from qic.models.qwen_image_21.host.sampling import (
    DEFAULT_STEPS,
    OUTPUT_RESOLUTION,
    VAE_SCALE,
    base_sigmas,
    image_seq_len,
    initial_noise,
    model_timesteps,
    output_size,
    schedule,
    to_images,
)
from qic.models.qwen_image_21.host.sequence import TEXT, JointSequence, prefix_inputs, prefix_sizes, rope_tables
from qic.parallel.mesh import from_each_branch
from qic.runtime.loop import Previews, denoise_loop, record_steps

# One image's run options: the rows of qic.host.options this program takes (steps None: the checkpoint's
# sample_sigmas, else the pipeline's 40; guidance None: the pipeline's true_cfg_scale default, 1, CFG off;
# kv_cache None or True: the prefix K/V kept, False: the prefill at every step, the pipeline's use_kv_cache=False).
Request = request_class("Request", __name__, [],
                        "One Qwen-Image-2.1 image's run options (the rows of qic.host.options it takes).",
                        only=("negative_prompt", "steps", "guidance", "seed", "height", "width", "kv_cache", "image",
                              "output_resolution", "nearest_condition_size"))


Result = ConditionedResult


@dataclass
class _Branch:
    """One CFG branch's per-request tensors, and its resident prefix K/V once prefilled."""
    text: torch.Tensor
    index: torch.Tensor
    block_ids: torch.Tensor
    key_valid: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv: tuple | None = None


def _defaults(model, req: Request, images: list) -> tuple[Request, list, list]:
    """The request with the bundle's (else the pipeline's) defaults filled in, the condition images' sizes, and a
    note per image fitted to the nearest built size (--nearest-condition-size)."""
    d = model.defaults
    sample = model.manifest.get("sample_sigmas")
    if req.steps is None:
        req.steps = d.get("steps", len(sample) if sample else DEFAULT_STEPS)
    elif sample and req.steps != len(sample):
        raise ConfigError(f"the checkpoint samples on its {len(sample)} sample_sigmas; steps {req.steps} differs",
                          f"drop --steps, or give --steps {len(sample)}")
    if req.guidance is None:
        req.guidance = d.get("guidance", 1.0)
    if req.seed is None:
        req.seed = 0
    if req.output_resolution is None:
        req.output_resolution = d.get("output_resolution", OUTPUT_RESOLUTION)
    sizes, fitted = (condition_sizes(images, model.manifest["conditions"], req.output_resolution,
                                     bool(req.nearest_condition_size)) if images else ([], []))
    if images and (req.height is None or req.width is None):
        # the pipeline's: the last condition image's aspect at output_resolution**2 pixels, what is given kept
        req.height, req.width = output_size(req.output_resolution, images[-1].size[::-1], req.height, req.width)
    elif req.height is None and req.width is None:
        req.height, req.width = model.resolutions[0]
    model.check_resolution(req.height, req.width)
    return req, sizes, fitted


def _ids(model, prompt: str) -> list[int]:
    return model.tokenizer.encode(prompt_text(prompt)).ids


def _tokens(model, req: Request, sizes: list[tuple[int, int]]) -> tuple[list[list[int]], int, bool]:
    """Each CFG branch's token ids (the prompt, then the negative prompt when true CFG is on), the text bucket and
    whether CFG is on. With condition images the ti2i template, each image's <|image_pad|> expanded to its vision
    tokens (its slots); the bucket holds the prompt's own tokens, the slots being the images form's extra length."""
    cfg = req.guidance > 1 and req.negative_prompt is not None
    prompts = [req.prompt] + ([req.negative_prompt] if cfg else [])
    if not sizes:
        ids = [_ids(model, p) for p in prompts]
        return ids, pick_bucket(max(map(len, ids)), model.buckets), cfg
    cond = model.manifest["conditions"]
    merge = cond["processor"]["merge_size"]
    grids = vision_grids(cond, sizes)
    slots = sum(g[1] * g[2] // merge ** 2 for g in grids)
    ids = [model.tokenizer.encode(expand_image_pads(prompt_text(p, len(grids)), grids, merge)).ids for p in prompts]
    for i in ids:
        if i.count(cond["image_token_id"]) != slots:   # the tokenizer must keep <|image_pad|> one token
            raise ConfigError(f"the bundle's tokenizer splits {IMAGE_PAD}: {i.count(cond['image_token_id'])} image "
                              f"tokens for {slots} slots")
    return ids, pick_bucket(max(map(len, ids)) - slots, model.buckets), cfg


def plan(model, req: Request) -> tuple:
    """qic serve's admission of a request (qic.runtime.programs): checked as generate checks it before any graph
    runs (steps against the checkpoint's sample_sigmas, the size, the images, the prompt against the buckets), its
    defaults filled in. 2.1 bundles are batch 1, so each request is a batch of its own: its key is its own."""
    images = read_images(req.image, model.manifest.get("conditions") or {})
    req, sizes, _ = _defaults(model, req, images)
    _tokens(model, req, sizes)
    return ("request", id(req))


def _branch(model, encoder, ids: list[int], bucket: int, target: tuple[int, int], axes,
            cond: Conditions | None = None) -> _Branch:
    """One branch's text rows and sequence tensors. With condition images the encoder graph is the images form,
    over bucket + slots tokens, and the prefix interleaves the text rows with the images' latent tokens where the
    encoder reserved their slots (sequence.JointSequence.from_slots)."""
    drop = model.prompt["drop_tokens"]
    slots = cond.slots if cond is not None else 0
    length = bucket + slots
    padded = torch.zeros(1, length, dtype=torch.long)
    padded[0, :len(ids)] = torch.tensor(ids)
    mask = (torch.arange(length) < len(ids)).long()[None]
    if cond is None:
        hidden = encoder(padded, mask)[0]
    else:
        positions = mrope_positions(ids, cond.image_token_id, cond.vision_grids, cond.merge_size, length=length)
        hidden = encoder(padded, mask, positions, cond.embeds, cond.deepstack)[0]
    rows = len(ids) - drop
    text = torch.zeros_like(hidden)
    text[:, :rows] = hidden[:, drop:len(ids)]
    if cond is None:
        seq = JointSequence(((TEXT, rows),), target)
    else:
        seq = JointSequence.from_slots([i == cond.image_token_id for i in ids[drop:]], cond.grids, target)
    text_rows, _, prefix = prefix_sizes(bucket, slots)
    index, block_ids, key_valid = prefix_inputs(seq, prefix, text_rows)
    cos, sin = rope_tables(axes, seq, prefix)
    return _Branch(text, index, block_ids, key_valid.long(), cos, sin)


def generate(model, req: Request, previews: Previews | None = None) -> Result:
    timings: dict[str, float] = {}
    t = time.perf_counter()
    images = read_images(req.image, model.manifest.get("conditions") or {})
    req, sizes, fitted = _defaults(model, req, images)
    h, w = req.height, req.width
    ids, bucket, cfg = _tokens(model, req, sizes)
    timings["tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    cond = encode_conditions(model, images, sizes) if images else None
    encoder = model.graph("text_encoder", bucket=bucket, part="images" if cond else None)
    grid = (h // VAE_SCALE, w // VAE_SCALE)
    axes = model.manifest["denoiser"]["axes_dims_rope"]
    split = cfg and model.layout.cfg > 1          # CFG-parallel: this rank's CFG group runs one branch
    mine = [ids[model.coords["cfg"]]] if split else ids
    branches = [_branch(model, encoder, i, bucket, grid, axes, cond) for i in mine]
    timings["encode"] = time.perf_counter() - t

    sigmas = base_sigmas(model.manifest.get("sample_sigmas"), req.steps)
    sched = schedule(model.scheduler, sigmas, image_seq_len(h, w))
    timesteps = model_timesteps(sched)
    suffix = "-images" if cond else ""
    prefill = model.graph("denoiser", (h, w), bucket, part="prefill" + suffix)
    decode = model.graph("denoiser", (h, w), bucket, part="decode" + suffix)
    n = len(branches[0].index)    # the prefix length P: the RoPE tables' target rows follow it
    extra = (cond.latents,) if cond else ()

    def step(i, latents, t, sigma, sigma_next):
        """One step for qic.runtime.loop's loop (the one every family's program runs): each branch's prefill on
        the first step (every step without the KV cache), its decode after; the CFG exchange under CFG-parallel;
        true CFG; the Euler update in fp32."""
        ts = timesteps[i:i + 1]
        preds = []
        for b in branches:
            if b.kv is None or req.kv_cache is False:
                pred, k, v = prefill(b.text, *extra, latents, ts, b.index, b.block_ids, b.key_valid, b.cos, b.sin)
                b.kv = (k, v)
            else:
                (pred,) = decode(latents, ts, *b.kv, b.key_valid, b.cos[n:], b.sin[n:])
            preds.append(pred.float())
        if split:
            preds = from_each_branch(model.layout, preds[0])
        pred = preds[1] + req.guidance * (preds[0] - preds[1]) if cfg else preds[0]
        return latents.float() + (sigma_next - sigma) * pred

    latents = denoise_loop(step, initial_noise(req.seed, model.latents["z_dim"], h, w), sched,
                           on_step=record_steps(timings), previews=previews,
                           decode=lambda x0, wanted: [to_images(model.graph("vae_decoder", (h, w))(x0)[0])[0]])

    t = time.perf_counter()
    (pixels,) = model.graph("vae_decoder", (h, w))(latents)
    image = to_images(pixels)[0]
    timings["decode"] = time.perf_counter() - t
    described = ", ".join(f"{a}x{b}" for a, b in sizes) + (f" ({'; '.join(fitted)})" if fitted else "")
    return Result(image, req, timings, bucket, described or None)
