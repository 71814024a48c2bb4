"""Text to image with a loaded bundle: tokenize, encode, the denoise loop over per-step scalars, decode.

The host only picks buckets, pads, and feeds scalars; every tensor op of the model runs in a graph.
Arithmetic matches diffusers' QwenImagePipeline step for step (same noise, schedule, CFG and decode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from qic.errors import ConfigError
from qic.host.aspect import pick_resolution
from qic.host.latents import initial_noise
from qic.host.prompt import pick_bucket
from qic.host.schedule import flow_match_schedule
from qic.runtime.bundle import Bundle

DEFAULT_STEPS, DEFAULT_GUIDANCE = 20, 4.0


@dataclass
class Request:
    prompt: str
    negative_prompt: str | None = " "   # None: no negative prompt, so no CFG (as in diffusers)
    steps: int | None = None            # None: the bundle's run default (else DEFAULT_STEPS)
    guidance: float | None = None       # None: the bundle's run default (else DEFAULT_GUIDANCE)
    seed: int = 0
    height: int | None = None
    width: int | None = None
    aspect: str | None = None           # 'W:H': the bundle's resolution of that aspect ratio


@dataclass
class Result:
    image: Image.Image
    request: Request
    timings: dict = field(default_factory=dict)   # seconds: tokenize, encode, step[i], decode
    bucket: int = 0                               # the text bucket used (0: exact length)


def validate(req: Request, bundle: Bundle) -> Request:
    if not isinstance(req.prompt, str) or not req.prompt:
        raise ConfigError("prompt must be a non-empty string")
    defaults = bundle.defaults
    if req.steps is None:
        req.steps = defaults.get("steps", DEFAULT_STEPS)
    if req.guidance is None:
        req.guidance = defaults.get("guidance", DEFAULT_GUIDANCE)
    if not isinstance(req.steps, int) or isinstance(req.steps, bool) or req.steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {req.steps!r}")
    if not isinstance(req.guidance, (int, float)) or not np.isfinite(req.guidance) or req.guidance < 0:
        raise ConfigError(f"guidance must be a finite number >= 0, got {req.guidance!r}")
    if req.aspect is not None:
        if req.height is not None or req.width is not None:
            raise ConfigError("give --aspect or --height/--width, not both")
        req.height, req.width = pick_resolution(req.aspect, bundle.resolutions)
    if req.height is None and req.width is None:
        req.height, req.width = bundle.resolutions[0]
    if req.height is None or req.width is None:
        raise ConfigError("give both --height and --width, or neither")
    bundle.check_resolution(req.height, req.width)
    return req


def generate(bundle: Bundle, req: Request) -> Result:
    req = validate(req, bundle)
    times: dict = {}
    t = time.perf_counter()
    plan = text_plan(bundle, req)
    cfg, ids_pos, ids_neg, bucket = plan.cfg, plan.ids_pos, plan.ids_neg, plan.bucket
    res = (req.height, req.width)
    drop = bundle.prompt["drop_tokens"]
    length = bucket or max(len(ids_pos), len(ids_neg))
    # Without CFG the no-CFG step graph (batch 1, one transformer call a step) runs when the bundle has
    # it; else the CFG graph with the uncond row repeating the prompt and guidance 1, which makes the
    # combination exactly the cond prediction at twice the cost.
    batched = cfg or not bundle.has_graph("denoiser", res, bucket, cfg=False)
    if cfg and not bundle.has_graph("denoiser", res, bucket, cfg=True):
        raise ConfigError(f"guidance {req.guidance} asks for true CFG, but this bundle has only the no-CFG step graph",
                          "run with --guidance 1, or rebuild with `cfg: [true, false]` in the config")
    times["tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    encoder = bundle.graph("text_encoder", bucket=bucket)
    embeds, masks = [], []
    for ids in ([ids_pos, ids_neg] if cfg else [ids_pos]):
        padded = torch.zeros(1, length, dtype=torch.long)
        padded[0, :len(ids)] = torch.tensor(ids)
        mask = torch.zeros(1, length, dtype=torch.long)
        mask[0, :len(ids)] = 1
        hidden = encoder(padded, mask)[0]
        embeds.append(hidden[:, drop:])
        masks.append(mask[:, drop:])
    if batched and not cfg:
        embeds, masks = embeds * 2, masks * 2
    text = torch.cat(embeds, 0)
    text_mask = torch.cat(masks, 0)
    times["encode"] = time.perf_counter() - t

    lat = bundle.latents
    sf = lat["vae_scale_factor"]
    noise = initial_noise(req.seed, lat["z_dim"], req.height, req.width, sf)
    schedule = flow_match_schedule(bundle.scheduler, req.steps, noise.shape[1])
    step = bundle.graph("denoiser", res, bucket, cfg=batched)
    guidance = [torch.tensor(float(req.guidance) if cfg else 1.0, dtype=torch.float32)] if batched else []
    x = noise
    for i in range(req.steps):
        t = time.perf_counter()
        x = step(x, text, text_mask, schedule.timesteps[i], schedule.sigmas[i], schedule.sigmas[i + 1], *guidance)[0]
        times[f"step{i}"] = time.perf_counter() - t

    t = time.perf_counter()
    image = bundle.graph("vae_decoder", (req.height, req.width))(x.float())[0]
    times["decode"] = time.perf_counter() - t
    return Result(to_pil(image), req, times, bucket)


@dataclass
class TextPlan:
    cfg: bool                 # true CFG on: the uncond row encodes the negative prompt
    ids_pos: list[int]
    ids_neg: list[int]        # the prompt's ids again when CFG is off
    bucket: int               # the text bucket (0: exact length)


def text_plan(bundle: Bundle, req: Request) -> TextPlan:
    """Tokenize and pick the bucket; a prompt longer than the model takes is a ConfigError."""
    # True CFG as diffusers does it: on when guidance > 1 and a negative prompt is given. Off, the uncond
    # row repeats the prompt with guidance 1, which makes the combination exactly the cond prediction.
    cfg = req.guidance > 1 and req.negative_prompt is not None
    limit = bundle.prompt["max_tokens"] + bundle.prompt["drop_tokens"]
    ids_pos = _ids(bundle, req.prompt)
    ids_neg = _ids(bundle, req.negative_prompt) if cfg else ids_pos
    longest = max(len(ids_pos), len(ids_neg))
    if longest > limit:
        raise ConfigError(f"prompt is {longest} tokens with the template; the model takes at most {limit}")
    return TextPlan(cfg, ids_pos, ids_neg, pick_bucket(longest, bundle.buckets))


def _ids(bundle: Bundle, prompt: str) -> list[int]:
    return bundle.tokenizer.encode(bundle.prompt["template"].format(prompt)).ids


def to_pil(image: torch.Tensor) -> Image.Image:
    """[1, 3, H, W] in [-1, 1] -> PIL, rounded as diffusers' VaeImageProcessor does."""
    x = (image[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy()
    return Image.fromarray((x * 255).round().astype("uint8"))
