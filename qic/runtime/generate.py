"""Text to image with a loaded bundle: tokenize, encode, the denoise loop over per-step scalars, decode.

The host only picks buckets, pads, and feeds scalars; every tensor op of the model runs in a graph.
Arithmetic matches diffusers' QwenImagePipeline step for step (same noise, schedule, CFG and decode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from PIL import Image

from qic.errors import ConfigError
from qic.host.aspect import pick_resolution
from qic.host.cache_policy import CacheSettings, settings_from
from qic.host.condition_images import as_list, loaded, mask_pixels, vae_pixels
from qic.host.latents import initial_noise, pack
from qic.host.options import CACHE_FIELDS, REQUEST_OPTIONS, request_class
from qic.host.prompt import pick_bucket
from qic.host.schedule import Schedule, flow_match_schedule
from qic.parallel.mesh import gather_objects, group_done, share_from, wait_for_group
from qic.runtime.loop import Previews, denoise_loop, record_steps
from qic.runtime.lora import Adapters, parse_choices
from qic.runtime.protocol import Runnable
from qic.runtime.step_cache import cached_step

DEFAULT_STEPS, DEFAULT_GUIDANCE = 20, 4.0
DEFAULT_STRENGTH = 0.6   # QwenImageImg2ImgPipeline's


# What one image asks for: qic.host.options' rows (prompt, negative_prompt, steps, guidance, seed, height, width,
# aspect, the step-caching settings), then what validate() resolves.
Request = request_class("Request", __name__, [
    ("cache", CacheSettings | None, field(default=None, init=False, repr=False)),   # step caching, resolved
], "One image's run options (qic.host.options: a row each; None: not given, then the bundle's run default, "
   "else the runtime's). Everything after the prompt is keyword-only.",
    only=tuple(o.name for o in REQUEST_OPTIONS if not o.opt_in) + ("image", "strength", "mask", "lora"))


@dataclass
class Result:
    image: Image.Image
    request: Request
    timings: dict = field(default_factory=dict)   # seconds: tokenize, encode, step[i], decode
    bucket: int = 0                               # the text bucket used (0: exact length)
    # Step caching: per text row (cond rows of the batch's images, then uncond rows) the steps that computed
    # their middle blocks; None when caching was off (every step computed).
    computed: list[list[int]] | None = None
    figures: list[list] | None = None             # per row, each step's figure (None where none was read)


def validate(req: Request, bundle: Runnable) -> Request:
    """Each option checked by its row (qic.host.options), the bundle's run defaults filled in, the resolution
    and step caching checked against the bundle."""
    defaults = bundle.defaults
    if req.steps is None:
        req.steps = defaults.get("steps", DEFAULT_STEPS)
    if req.guidance is None:
        req.guidance = defaults.get("guidance", DEFAULT_GUIDANCE)
    for option in REQUEST_OPTIONS:   # 4 and 4.0 are one guidance (and write one PNG): float options give floats
        # step caching's: settings_from below, the bundle's defaults included; rows of other programs (opt_in) absent
        # the image and the mask: file paths or decoded images (qic serve's uploads), _check_img2img's to read
        # lora: parse_choices below (strings, or a served request's objects)
        if option.name not in (*CACHE_FIELDS, "image", "mask", "lora") and option.name in Request.__dataclass_fields__:
            setattr(req, option.name, option.check(getattr(req, option.name)))
    if req.aspect is not None:
        if req.height is not None or req.width is not None:
            raise ConfigError("give --aspect or --height/--width, not both")
        req.height, req.width = pick_resolution(req.aspect, bundle.resolutions)
    if req.height is None and req.width is None:
        req.height, req.width = bundle.resolutions[0]
    if req.height is None or req.width is None:
        raise ConfigError("give both --height and --width, or neither")
    bundle.check_resolution(req.height, req.width)
    req.cache = settings_from({k: getattr(req, k) if getattr(req, k) is not None else defaults.get(k)
                               for k in CACHE_FIELDS})
    if req.cache.active and not bundle.step_cache:
        raise ConfigError("step caching (cache_threshold / cache_steps) needs a bundle built with step_cache",
                          "rebuild with --step-cache 1,0 (diffusers' FirstBlockCache) or e.g. 8,0 (cache-dit's)")
    if req.cache.active and req.cache.steps is None and bundle.lockstep and bundle.layout.cfg > 1:
        raise ConfigError("step caching by threshold on a CFG-parallel bundle cannot run on this device: it runs "
                          "the ranks' graphs in lockstep, and each CFG group decides its own steps",
                          "give --cache-steps (one mask for both groups), or run on the bundle's own device")
    if req.cache.steps is not None and req.cache.steps[-1] >= req.steps:
        raise ConfigError(f"cache_steps names step {req.cache.steps[-1]}, but the run has {req.steps} steps "
                          f"(0..{req.steps - 1})")
    if req.image is not None or req.strength is not None or req.mask is not None:
        _check_img2img(req, bundle)
    if req.lora:
        req.lora = parse_choices(req.lora)
        adapters_of(bundle).resolve(req.lora)    # unknown names, files and ranks: refused before any work
    return req


def adapters_of(bundle: Runnable):
    """The bundle's per-request adapters (qic.runtime.lora.Adapters): a server's, named at its start, else (qic run)
    made on first use, naming files by path; a bundle without LoRA slots refuses in one line."""
    adapters = getattr(bundle, "adapters", None)
    if adapters is None:
        if not getattr(bundle, "lora_slots", 0):
            raise ConfigError("lora: this bundle takes no adapters per request (built without --lora-slots)",
                              "rebuild with --lora-slots R, or merge the LoRA at build time (qic build --lora)")
        adapters = bundle.adapters = Adapters(bundle, files=True)
    return adapters


def _check_img2img(req: Request, bundle: Runnable) -> None:
    """img2img's request: one image (decoded now: a bad file is one line naming it) on a bundle with the VAE
    encoder's sample graphs, a strength in (0, 1] (which always leaves a step: strength_start truncates)."""
    if not bundle.manifest.get("img2img"):
        raise ConfigError("img2img (--image on a text-to-image bundle) needs the VAE encoder's graphs, which this "
                          "bundle lacks", "rebuild with --components text_encoder,denoiser,vae_decoder,vae_encoder")
    if req.image is None:
        raise ConfigError(f"{'mask' if req.mask is not None else 'strength'} is img2img's and inpaint's: give the "
                          "image to start from (--image)")
    images = as_list(req.image)
    if len(images) != 1:
        raise ConfigError(f"img2img starts from one image; {len(images)} given")
    req.image = [loaded(images[0])]
    if req.mask is not None:
        req.mask = loaded(req.mask)
        if req.mask.size != req.image[0].size:
            raise ConfigError(f"the mask is {req.mask.width}x{req.mask.height} pixels, the image "
                              f"{req.image[0].width}x{req.image[0].height}: inpaint takes a mask of the image's size")
    if req.strength is None:
        req.strength = bundle.defaults.get("strength", DEFAULT_STRENGTH)
    if not 0 < req.strength <= 1:
        raise ConfigError(f"strength must be in (0, 1], got {req.strength}")
    if req.cache.active:
        raise ConfigError("step caching with img2img: not yet", "drop the cache options")


def strength_start(steps: int, strength: float) -> int:
    """The first step img2img runs (the pipeline's get_timesteps: the last strength x steps steps)."""
    return int(max(steps - min(steps * strength, steps), 0))


@dataclass
class Start:
    """Where img2img and inpaint start: the first latents, the schedule from the first step run, and what inpaint
    blends back each step (the image's latents and the noise; None for img2img)."""
    latents: torch.Tensor
    schedule: Schedule
    blend: object = None   # (i, latents, sigma_next) -> latents


def img2img_start(bundle: Runnable, req: Request, schedule: Schedule) -> Start:
    """As QwenImageImg2ImgPipeline and QwenImageInpaintPipeline start for the request's seed: the VAE posterior's
    noise, then the latents' noise, from one CPU generator; the image's sample (the encoder's sample graph) noised
    to the first step's sigma (the scheduler's scale_noise). With a mask, each step's latents keep the image where
    the mask is black (0): the image's latents noised to the step's next sigma (0 after the last: the image), the
    mask taken to the latent grid by nearest sampling, as the pipeline's prepare_mask_latents (its encode of the
    masked image draws from the generator after both, and the transformer never reads it)."""
    lat = bundle.latents
    z, sf = lat["z_dim"], lat["vae_scale_factor"]
    h, w = req.height, req.width
    gen = torch.Generator("cpu").manual_seed(req.seed)
    posterior = torch.randn((1, z, 1, h // sf, w // sf), generator=gen, dtype=torch.float32)[:, :, 0]
    noise = pack(torch.randn((1, 1, z, h // sf, w // sf), generator=gen, dtype=torch.float32)[:, 0])
    (image,) = bundle.graph("vae_encoder", (h, w), part="sample")(vae_pixels(req.image[0], (h, w)), posterior)
    first = strength_start(req.steps, req.strength)
    sigma = schedule.sigmas[first]
    rest = Schedule(schedule.sigmas[first:], schedule.timesteps[first:])
    blend = None
    if req.mask is not None:
        mask = F.interpolate(mask_pixels(req.mask, (h, w)), size=(h // sf, w // sf))
        mask = pack(mask.expand(1, z, h // sf, w // sf))

        def blend(i, x, sigma_next):   # after the last step sigma_next is 0: the image itself, as the pipeline's
            known = sigma_next * noise + (1.0 - sigma_next) * image
            return (1 - mask) * known + mask * x
    return Start(sigma * noise + (1.0 - sigma) * image, rest, blend)


def generate(bundle: Runnable, req: Request, previews: Previews | None = None) -> Result:
    return generate_batch(bundle, [req], previews)[0]


def plan(bundle: Runnable, req: Request) -> tuple:
    """qic serve's admission of a request (qic.runtime.programs): checked as a run would check it, its defaults
    filled in, and its batch key; requests with equal keys may share a batch of the bundle's batch sizes."""
    validate(req, bundle)
    return batch_key(req, text_plan(bundle, req))


def generate_batch(bundle: Runnable, reqs: list[Request], previews: Previews | None = None) -> list[Result]:
    """Run compatible requests (equal `batch_key`) as one batch through the graphs of that batch size
    (the batch-1 graphs for one request; `@B<n>` graphs, built by `batch_sizes`, for n). Each request
    keeps its own prompt, negative prompt, seed and guidance: the step graph takes guidance as one scale
    per image ([n]; a 0-dim scalar at batch 1). Timings are the batch's, shared by its results. previews:
    qic.runtime.loop's, the images each step predicts (decoded by the batch-1 decoder graph, on demand)."""
    reqs = [validate(r, bundle) for r in reqs]
    n = len(reqs)
    times: dict = {}
    t = time.perf_counter()
    plans = [text_plan(bundle, r) for r in reqs]
    if len({batch_key(r, p) for r, p in zip(reqs, plans)}) != 1:
        raise ConfigError("requests of one batch must share resolution, text bucket, steps and CFG mode, and "
                          "step caching settings")
    first = reqs[0]
    cfg, bucket = plans[0].cfg, plans[0].bucket
    res = (first.height, first.width)
    drop = bundle.prompt["drop_tokens"]
    # Without CFG the no-CFG step graph (one transformer call a step) runs when the bundle has it;
    # else the CFG graph with the uncond rows repeating the prompts and guidance 1, which makes the
    # combination exactly the cond prediction at twice the cost.
    batched = cfg or not bundle.has_graph("denoiser", res, bucket, cfg=False, batch=n)
    if cfg and not bundle.has_graph("denoiser", res, bucket, cfg=True, batch=n):
        raise _no_cfg_graph(first.guidance)
    # CFG-parallel without CFG (the no-CFG graph: one prediction a step, no second branch to compute): the two
    # CFG groups take halves of the batch (an image's pixels do not depend on its batch), or with one image (or
    # no graph of the halves' sizes) group 1 idles and takes group 0's latents after the loop.
    share = bundle.layout.cfg > 1 and not batched
    bounds = share_of(bundle, res, bucket, n, first.cache.active) if share else [(0, n)]
    idler = share and bounds[1][0] == bounds[1][1]      # CFG group 1 has nothing to denoise
    if idler and bundle.lockstep:   # every rank decides this alike: all refuse, none waits
        raise ConfigError(f"guidance <= 1 with {n} image(s) on this CFG-parallel bundle idles CFG group 1, which "
                          "this device cannot do: it runs the ranks' graphs in lockstep",
                          "give guidance > 1, a batch of two or more (with --batch-sizes' graphs), or run on the "
                          "bundle's own device")
    times["tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    encoder = bundle.graph("text_encoder", bucket=bucket, batch=n)
    embeds, masks = [], []
    # Text rows: the n prompts, then (CFG) their n negative prompts, as DenoiseStep splits them; with exact-length
    # text each branch is encoded at its own length (the step graph may take them so: packed CFG).
    for rows in ([[p.ids_pos for p in plans], [p.ids_neg for p in plans]] if cfg else [[p.ids_pos for p in plans]]):
        length = bucket or max(len(ids) for ids in rows)
        padded = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.long)
        for i, ids in enumerate(rows):
            padded[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        hidden = encoder(padded, mask)[0]
        embeds.append(hidden[:, drop:])
        masks.append(mask[:, drop:])
    if batched and not cfg:
        embeds, masks = embeds * 2, masks * 2
    text, text_mask = padded_rows(embeds, masks)
    times["encode"] = time.perf_counter() - t

    lat = bundle.latents
    sf = lat["vae_scale_factor"]
    noise = torch.cat([initial_noise(r.seed, lat["z_dim"], r.height, r.width, sf) for r in reqs], 0)
    schedule = flow_match_schedule(bundle.scheduler, first.steps, noise.shape[1])
    blend = None
    if first.image is not None:   # img2img and inpaint: a batch of one (batch_key), from the image at its strength
        start = img2img_start(bundle, first, schedule)
        noise, schedule, blend = start.latents, start.schedule, start.blend
    scales = [float(r.guidance) if cfg else 1.0 for r in reqs]
    guidance = [torch.tensor(scales[0] if n == 1 else scales, dtype=torch.float32)] if batched else []
    lo, hi = bounds[bundle.coords["cfg"]] if share else bounds[0]
    x, rows_state = noise[lo:hi], None
    if hi == lo:
        t = time.perf_counter()
        wait_for_group(bundle.layout, "cfg", 0)          # outside any collective: a loop outlasts their timeout
        times["idle"] = time.perf_counter() - t
    else:
        if share:   # one text row an image (the no-CFG graph): this group's images' rows
            text, text_mask = text[lo:hi], text_mask[lo:hi]
        def decode(x0, wanted):   # the wanted images of the batch's n that this rank holds ([lo, hi))
            return [to_pil(bundle.graph("vae_decoder", res)(x0[j - lo:j - lo + 1])[0])
                    if j in wanted and lo <= j < hi else None for j in range(n)]
        x, rows_state = denoise(bundle, first, res, bucket, batched, x, text, text_mask, schedule, guidance, times,
                                blend, previews=previews, decode=decode, branches=embeds,
                                loras=[r.lora for r in reqs[lo:hi]])
    if share:
        if idler and hi > lo:
            group_done()
        x, rows_state = both_halves(bundle, noise, x, rows_state, bounds, first.cache.active)
    t = time.perf_counter()
    images = bundle.graph("vae_decoder", res, batch=n)(x.float())[0]
    times["decode"] = time.perf_counter() - t
    rows = 2 if batched else 1

    def of_image(i: int, what: str):   # image i's rows: its cond row, then (CFG graph) its uncond row
        return None if rows_state is None else [getattr(rows_state[i + k * n], what) for k in range(rows)]
    return [Result(to_pil(images[i:i + 1]), r, dict(times), bucket, of_image(i, "computed"), of_image(i, "figures"))
            for i, r in enumerate(reqs)]


def denoise(bundle: Runnable, req: Request, res, bucket, cfg: bool, x, text, text_mask, schedule, guidance: list,
            times: dict, blend=None, previews: Previews | None = None, decode=None, branches=None, loras=None):
    """The denoise loop over x's images: (final latents, step-cache rows or None). One step graph a step, or
    with step caching on the split graphs (qic/runtime/step_cache.py); the loop is the same one. blend: inpaint's
    (i, latents, sigma_next) -> latents after each step (img2img_start). previews, decode: the loop's
    (qic.runtime.loop). branches: the text rows of each branch unpadded ([prompts], [negative prompts]), which a
    packed-CFG step graph takes in place of text and text_mask. loras: each image's adapters (Request.lora), which a
    slotted step graph takes as inputs (qic.runtime.lora)."""
    batch = x.shape[0]
    hooks = {"previews": previews, "decode": decode}
    bind = None
    if any(loras or []):
        adapters = adapters_of(bundle)
        bind = lambda graph: adapters.bind(graph, [lo or [] for lo in loras])   # noqa: E731
    if req.cache.active:
        step, decisions = cached_step(bundle, req.cache, res, bucket, cfg, batch, text, text_mask, guidance, bind)
        return denoise_loop(step, x, schedule, record_steps(times), **hooks), decisions.state
    graph = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch)
    if bind is not None:
        graph = bind(graph)
    if any(spec["name"] == "negative_embeds" for spec in graph.inputs):   # packed CFG (graphs.packed_cfg)
        text, text_mask = branches

    def step(i, x, timestep, sigma, sigma_next):
        out = graph(x, text, text_mask, timestep, sigma, sigma_next, *guidance)[0]
        return out if blend is None else blend(i, out, sigma_next)
    return denoise_loop(step, x, schedule, record_steps(times), **hooks), None


def padded_rows(embeds: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Text rows of the branches, each [n, L_i, D] with its mask [n, L_i], as one [rows, max L_i, D] tensor (zeros
    past each row's length) and its mask: what a step graph over padded text takes."""
    length = max(e.shape[1] for e in embeds)
    text = torch.cat([F.pad(e, (0, 0, 0, length - e.shape[1])) for e in embeds], 0)
    return text, torch.cat([F.pad(m, (0, length - m.shape[1])) for m in masks], 0)


def share_of(bundle, res, bucket, n: int, cached: bool) -> list[tuple[int, int]]:
    """CFG-parallel without CFG: the images [lo, hi) each CFG group denoises. Group 0 takes the first ceil(n/2),
    group 1 the rest, when the bundle has the no-CFG graphs of both sizes; else group 0 takes all of them."""
    halves = [(0, (n + 1) // 2), ((n + 1) // 2, n)]
    parts = ("head", "rest", "tail") if cached else (None,)
    ok = n > 1 and all(bundle.has_graph("denoiser", res, bucket, cfg=False, batch=hi - lo, part=part)
                       for lo, hi in halves for part in parts)
    return halves if ok else [(0, n), (n, n)]


def both_halves(bundle, noise, x, rows_state, bounds, cached: bool):
    """Every image's latents (and step-cache rows) on every rank, each half from the CFG group that denoised it."""
    layout, me = bundle.layout, bundle.coords["cfg"]
    parts = [share_from(layout, "cfg", (x if c == me else noise[lo:hi]).float(), coord=c)
             for c, (lo, hi) in enumerate(bounds) if hi > lo]
    if cached:   # each CFG group's first rank holds its images' rows (None: the group idled)
        states = gather_objects("world", rows_state)[::layout.world // layout.cfg]
        rows_state = [row for s in states if s for row in s]
    return torch.cat(parts, 0), rows_state


def batch_key(req: Request, plan: TextPlan) -> tuple:
    """Requests with equal keys run the same graphs with the same scalars, so they can share a batch (img2img
    requests run alone)."""
    alone = ("img2img", id(req)) if req.image is not None else ()
    return (req.height, req.width, plan.bucket, req.steps, plan.cfg, req.cache, *alone)


@dataclass
class TextPlan:
    cfg: bool                 # true CFG on: the uncond row encodes the negative prompt
    ids_pos: list[int]
    ids_neg: list[int]        # the prompt's ids again when CFG is off
    bucket: int               # the text bucket (0: exact length)


def text_plan(bundle: Runnable, req: Request) -> TextPlan:
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
    bucket = pick_bucket(longest, bundle.buckets)
    # Checked here, where `qic serve` plans a request, so that a bundle without the CFG graph refuses it (400)
    # rather than failing it when its batch runs (500, and at tp>1 a rank out of step).
    if cfg and not bundle.has_graph("denoiser", (req.height, req.width), bucket, cfg=True, batch=1):
        raise _no_cfg_graph(req.guidance)
    return TextPlan(cfg, ids_pos, ids_neg, bucket)


def _no_cfg_graph(guidance) -> ConfigError:
    return ConfigError(f"guidance {guidance} asks for true CFG, but this bundle has only the no-CFG step graph",
                       "run with --guidance 1, or rebuild with `cfg: [true, false]` in the config")


def _ids(bundle: Runnable, prompt: str) -> list[int]:
    return bundle.tokenizer.encode(bundle.prompt["template"].format(prompt)).ids


def to_pil(image: torch.Tensor) -> Image.Image:
    """[1, 3, H, W] in [-1, 1] -> PIL, rounded as diffusers' VaeImageProcessor does."""
    x = (image[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy()
    return Image.fromarray((x * 255).round().astype("uint8"))
