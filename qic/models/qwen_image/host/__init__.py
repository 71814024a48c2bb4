"""Qwen-Image's editing host program (qic.runtime.programs): host code over an edit bundle's graphs, as diffusers'
QwenImageEditPlusPipeline edits (Qwen-Image-Edit-2509; -2511 is the same program over a zero_cond_t denoiser), and
QwenImageEditPipeline (Qwen-Image-Edit: one image, inline in its template, its vision side the VAE side's image).

Per request: the condition images sized as the pipeline sizes them (host/conditions.py: the VAE side at 1024*1024
pixels, the vision side at 384*384, each a built condition size and grid), each through the bundle's vae_encoder
and vision graphs; the Edit Plus template ("Picture i: <vision tokens>" per image, then the prompt) with each image's
<|image_pad|> expanded to its vision tokens, tokenised and right-padded to the smallest text bucket plus the
bundle's image slots; the text encoder's images form (the features written over the pads, mRoPE positions from
qic.host.image_tokens); its rows from the 64 dropped template tokens on, the image tokens' rows included. Then per
step the images form of the step graph over [noise | condition latents] with true CFG (guidance > 1 and a negative
prompt, norm-rescaled as the pipeline does; each branch encodes the same images), its RoPE tables over [text | noise
| conditions] computed here (host/rope.py: the condition grids move the text's positions), the Euler update; the
VAE decoder. The output size defaults to the last condition image's aspect at 1024*1024 pixels, as the pipeline's.

Parallel layouts: under TP every rank runs this program, the graphs' collectives making outputs whole; under
CFG-parallel the step graph's branch rows run on their CFG group (its rank inputs, filled by the runtime).

Host code only: no nn.Module, no model definition (the runtime imports it by name).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from PIL import Image

from qic.errors import ConfigError
from qic.host.condition_images import ConditionedResult, calculate_dimensions, vae_pixels
from qic.host.image_tokens import IMAGE_PAD, expand_image_pads, mrope_positions
from qic.host.latents import initial_noise
from qic.host.options import request_class
from qic.host.prompt import edit_prompt_text, pick_bucket
from qic.host.schedule import flow_match_schedule
from qic.models.qwen_image.host.conditions import (
    LATENT_PATCH,
    V1,
    Sized,
    areas,
    read_images,
    size_images,
    vision_input,
    vision_tokens,
)
from qic.models.qwen_image.host.rope import check_positions, position_tables, rope_positions
from qic.runtime.generate import DEFAULT_GUIDANCE, DEFAULT_STEPS, to_pil
from qic.runtime.loop import Previews, denoise_loop, record_steps

Request = request_class("Request", __name__, [],
                        "One edit's run options (the rows of qic.host.options the edit program takes).",
                        only=("negative_prompt", "steps", "guidance", "seed", "height", "width", "image",
                              "nearest_condition_size"))


Result = ConditionedResult


@dataclass
class _Conditions:
    """A request's condition images, encoded once for both CFG branches."""
    sized: list[Sized]
    embeds: torch.Tensor      # [slots, hidden]: the vision features in order, zero rows after
    latents: torch.Tensor     # [1, K, C]: the VAE encoder's packed tokens in order, zero rows after
    mask: torch.Tensor        # [1, K] int64: 1 on the images' tokens


def _defaults(model, req: Request):
    cond = model.manifest["conditions"]
    images = read_images(req.image, cond)
    sized, fitted = size_images(images, cond, bool(req.nearest_condition_size))
    d = model.defaults
    if req.steps is None:
        req.steps = d.get("steps", DEFAULT_STEPS)
    if req.guidance is None:
        req.guidance = d.get("guidance", DEFAULT_GUIDANCE)
    if req.seed is None:
        req.seed = 0
    derived = req.height is None and req.width is None
    if derived:
        # the pipelines': the last image's aspect at 1024*1024 pixels (Edit's one image; a model's own VAE-side
        # area where it records one), cut to multiples of 16
        last = images[-1]
        h, w = calculate_dimensions(areas(cond)[0], last.width / last.height)
        req.height, req.width = h // LATENT_PATCH * LATENT_PATCH, w // LATENT_PATCH * LATENT_PATCH
    if req.height is None or req.width is None:
        raise ConfigError("give both --height and --width, or neither")
    if derived and (req.height, req.width) not in [tuple(r) for r in model.resolutions]:
        built = ", ".join(f"{a}x{b}" for a, b in model.resolutions)
        area = areas(cond)[0]
        side = math.isqrt(area)
        raise ConfigError(f"the output size follows the last image's aspect at "
                          f"{f'{side}*{side}' if side * side == area else area} pixels, {req.height}x"
                          f"{req.width}, which this bundle was not built for (it has: {built})",
                          "give --height and --width of a built resolution, or rebuild with --resolution")
    model.check_resolution(req.height, req.width)
    return req, images, sized, fitted


def _tokens(model, req: Request, sized: list[Sized]) -> tuple[list[list[int]], int, bool]:
    """Each CFG branch's token ids (the prompt, then the negative prompt when true CFG is on), the text bucket
    (the tokens other than the image pads: the graphs hold the bundle's slots beside it) and whether CFG is on."""
    cond = model.manifest["conditions"]
    merge = cond["processor"]["merge_size"]
    grids = [(1, *s.grid) for s in sized]
    used = sum(vision_tokens(s.grid, merge) for s in sized)
    cfg = req.guidance > 1 and req.negative_prompt is not None
    prompts = [req.prompt] + ([req.negative_prompt] if cfg else [])
    plus = cond.get("edit") != V1
    ids = [model.tokenizer.encode(expand_image_pads(edit_prompt_text(p, len(sized), plus), grids, merge)).ids
           for p in prompts]
    for i in ids:
        if i.count(cond["image_token_id"]) != used:   # the tokenizer must keep <|image_pad|> one token
            raise ConfigError(f"the bundle's tokenizer splits {IMAGE_PAD}: {i.count(cond['image_token_id'])} image "
                              f"tokens for {used}")
    longest = max(map(len, ids)) - used
    if longest > max(model.buckets):
        raise ConfigError(f"the prompt is {longest} tokens with the edit template (image tokens aside); this bundle's "
                          f"largest text bucket is {max(model.buckets)}")
    return ids, pick_bucket(longest, model.buckets), cfg


def plan(model, req: Request) -> tuple:
    """qic serve's admission (qic.runtime.programs): checked as generate checks it before any graph runs. Edit
    bundles are batch 1, so each request is a batch of its own."""
    req, _, sized, _ = _defaults(model, req)
    _tokens(model, req, sized)
    return ("request", id(req))


def _encode_images(model, images: list[Image.Image], sized: list[Sized], timings: dict | None = None) -> _Conditions:
    """Each image through the VAE encoder and the vision tower at its size, padded to the bundle's capacities;
    `timings` gains the seconds of each ("vae_encoder", "vision": all images together)."""
    cond = model.manifest["conditions"]
    embeds, latents = [], []
    spent = {"vae_encoder": 0.0, "vision": 0.0}
    for img, s in zip(images, sized):
        t = time.perf_counter()
        (tokens,) = model.graph("vae_encoder", s.vae)(vae_pixels(img, s.vae))
        spent["vae_encoder"] += time.perf_counter() - t
        t = time.perf_counter()
        (feats,) = model.graph("vision", s.vae)(vision_input(img, s, cond["processor"]))
        spent["vision"] += time.perf_counter() - t
        latents.append(tokens[0])
        embeds.append(feats)
    if timings is not None:
        timings.update(spent)
    e, lat = torch.cat(embeds), torch.cat(latents)
    slots, capacity = cond["slots"], cond["cond_tokens"]
    if e.shape[0] > slots or lat.shape[0] > capacity:   # sizes and count are checked: only a lying manifest
        raise ConfigError(f"the condition images fill {e.shape[0]} slots and {lat.shape[0]} latent tokens; the "
                          f"bundle's graphs hold {slots} and {capacity}")
    mask = (torch.arange(capacity) < lat.shape[0]).long()[None]
    return _Conditions(sized, torch.cat([e, e.new_zeros(slots - e.shape[0], e.shape[1])]),
                       torch.cat([lat, lat.new_zeros(capacity - lat.shape[0], lat.shape[1])])[None], mask)


def _text_rows(model, encoder, ids: list[int], bucket: int, conds: _Conditions) -> tuple[torch.Tensor, torch.Tensor]:
    """One branch's denoiser text rows [1, T, D] and their mask [1, T]: the encoder's images form over bucket +
    slots tokens, from the dropped template tokens on."""
    cond = model.manifest["conditions"]
    n = bucket + cond["slots"]
    padded = torch.zeros(1, n, dtype=torch.long)
    padded[0, :len(ids)] = torch.tensor(ids)
    mask = (torch.arange(n) < len(ids)).long()[None]
    grids = [(1, *s.grid) for s in conds.sized]
    positions = mrope_positions(ids, cond["image_token_id"], grids, cond["processor"]["merge_size"], length=n)
    hidden = encoder(padded, mask, positions, conds.embeds)[0]
    drop = model.prompt["drop_tokens"]
    return hidden[:, drop:], mask[:, drop:]


def _rope(model, grid: tuple[int, int], text_len: int, conds: _Conditions) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin over [text | noise | condition capacity]: the spare condition rows' positions are any (zeros):
    their keys are masked and their queries' outputs dropped."""
    grids = [(s.vae[0] // LATENT_PATCH, s.vae[1] // LATENT_PATCH) for s in conds.sized]
    check_positions(*grid, text_len, grids)
    cos, sin = position_tables(model.manifest["denoiser"]["axes_dims_rope"], rope_positions(*grid, text_len, grids))
    spare = conds.latents.shape[1] - conds.mask.sum().item()
    return torch.cat([cos, cos.new_zeros(spare, cos.shape[1])]), torch.cat([sin, sin.new_zeros(spare, sin.shape[1])])


def generate(model, req: Request, previews: Previews | None = None) -> Result:
    timings: dict[str, float] = {}
    t = time.perf_counter()
    req, images, sized, fitted = _defaults(model, req)
    h, w = req.height, req.width
    ids, bucket, cfg = _tokens(model, req, sized)
    timings["tokenize"] = time.perf_counter() - t

    conds = _encode_images(model, images, sized, timings)

    t = time.perf_counter()
    encoder = model.graph("text_encoder", bucket=bucket, part="images")
    rows = [_text_rows(model, encoder, i, bucket, conds) for i in ids]
    # Without CFG the no-CFG graph when the bundle has it, else the CFG graph with the uncond row repeating the
    # prompt at guidance 1 (exactly the cond prediction, at twice the cost), as text-to-image does.
    nocfg = not cfg and model.has_graph("denoiser", (h, w), bucket, cfg=False, part="images")
    if not cfg and not nocfg:
        rows = rows * 2
    text = torch.cat([r[0] for r in rows])
    text_mask = torch.cat([r[1] for r in rows])
    timings["encode"] = time.perf_counter() - t

    lat = model.latents
    noise = initial_noise(req.seed, lat["z_dim"], h, w, lat["vae_scale_factor"])
    grid = (h // LATENT_PATCH, w // LATENT_PATCH)
    cos, sin = _rope(model, grid, text.shape[1], conds)
    schedule = flow_match_schedule(model.scheduler, req.steps, noise.shape[1])
    graph = model.graph("denoiser", (h, w), bucket, cfg=not nocfg, part="images")
    guidance = [] if nocfg else [torch.tensor(float(req.guidance) if cfg else 1.0)]

    def step(i, x, timestep, sigma, sigma_next):
        return graph(x, text, text_mask, timestep, sigma, sigma_next, *guidance, conds.latents, conds.mask,
                     cos, sin)[0]
    x = denoise_loop(step, noise, schedule, record_steps(timings), previews=previews,
                     decode=lambda x0, wanted: [to_pil(model.graph("vae_decoder", (h, w))(x0)[0])])

    t = time.perf_counter()
    image = model.graph("vae_decoder", (h, w))(x.float())[0]
    timings["decode"] = time.perf_counter() - t
    described = ", ".join(f"{s.vae[0]}x{s.vae[1]}" for s in sized) + (f" ({'; '.join(fitted)})" if fitted else "")
    return Result(to_pil(image), req, timings, bucket, described)
