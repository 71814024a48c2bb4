"""Qwen-Image-2.1's host arithmetic, as diffusers' QwenImage21Pipeline (0.42) does it: the sigma schedule
(the checkpoint's `sample_sigmas`, Turbo's, else the linspace default), the dynamic shift mu, the timesteps the
transformer is fed, the output size from `output_resolution` and the last condition image, the condition images'
resize (VAE side and vision side), the latent tokens (patch size 1: one token per 16x16 pixel tile) and the
initial noise, and the RGBA images going in and out.

No graph runs here; torch appears only for the tensors handed to the graphs (the schedule, the noise, the pixels).
Sizes are (height, width) in qic's order; the pipeline's helpers return (width, height), and the conversions are
written where they happen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from qic.errors import ConfigError
from qic.host.condition_images import calculate_dimensions
from qic.host.schedule import Schedule, schedule_of

VAE_SCALE = 16  # the pipeline hard-codes it (`self.vae_scale_factor = 16`), whatever the VAE config says
SIZE_MULTIPLE = 2 * VAE_SCALE  # output sizes are cut down to multiples of 32
OUTPUT_RESOLUTION = 1024  # __call__'s default `output_resolution`
DEFAULT_STEPS = 40  # __call__'s default `num_inference_steps`


# --------------------------------------------------------------------------------------------- schedule

def base_sigmas(sample_sigmas: Sequence[float] | None, steps: int = DEFAULT_STEPS) -> np.ndarray:
    """The sigmas before the scheduler's processing: the checkpoint's `sample_sigmas` (model_index.json; Turbo),
    whose length is the step count, else linspace(1, 1/steps, steps). float32, as set_timesteps casts them."""
    if sample_sigmas is not None:
        sigmas = np.array(list(sample_sigmas), dtype=np.float64)
        if sigmas.ndim != 1 or len(sigmas) == 0 or not np.all(np.isfinite(sigmas)):
            raise ConfigError(f"sample_sigmas must be a non-empty list of numbers, got {sample_sigmas!r}")
        if np.any(sigmas <= 0) or np.any(sigmas > 1):
            # 0 would make the exponential shift divide by zero; the terminal 0 is appended, never listed
            raise ConfigError("sample_sigmas must lie in (0, 1] (the terminal sigma 0 is not listed)")
    else:
        if steps < 1:
            raise ConfigError(f"steps must be >= 1, got {steps}")
        sigmas = np.linspace(1.0, 1 / steps, steps)
    return sigmas.astype(np.float32)


def image_seq_len(height: int, width: int) -> int:
    """Target tokens of an output size: the pipeline's `latents.shape[1]` (condition tokens do not count)."""
    return (height // VAE_SCALE) * (width // VAE_SCALE)


def schedule(scheduler_config: Mapping, sigmas: np.ndarray, seq_len: int) -> Schedule:
    """FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...) on the given sigmas (Qwen-Image's own
    arithmetic: qic.host.schedule.schedule_of), mu from the target tokens only."""
    return schedule_of(scheduler_config, sigmas, seq_len)


def model_timesteps(sched: Schedule) -> torch.Tensor:
    """What the transformer is given each step: `t / 1000` in float32 (t = sigma * 1000, so not exactly sigma)."""
    return sched.timesteps.to(torch.float32) / 1000


# ---------------------------------------------------------------------------------------------- sizes

def condition_size(image_height: int, image_width: int,
                   output_resolution: int = OUTPUT_RESOLUTION) -> tuple[int, int]:
    """VAE-side (and processor-input) size of a condition image: output_resolution**2 pixels at its aspect."""
    h, w = calculate_dimensions(output_resolution * output_resolution, image_width / image_height)
    if h == 0 or w == 0:  # the pipeline would fail in the resize; say why instead
        raise ConfigError(f"a {image_height}x{image_width} condition image at output_resolution "
                          f"{output_resolution} rounds to {h}x{w}")
    return h, w


def output_size(output_resolution: int = OUTPUT_RESOLUTION, last_condition: tuple[int, int] | None = None,
                height: int | None = None, width: int | None = None) -> tuple[int, int]:
    """The generated image's (height, width): what is given, else the last condition image's aspect at
    output_resolution**2 pixels, else output_resolution square; then cut down to multiples of 32."""
    if last_condition is not None:
        h, w = condition_size(*last_condition, output_resolution)
        height, width = height or h, width or w
    height, width = height or output_resolution, width or output_resolution
    return height // SIZE_MULTIPLE * SIZE_MULTIPLE, width // SIZE_MULTIPLE * SIZE_MULTIPLE


# -------------------------------------------------------------------------------------------- images

def condition_rgba(image: Image.Image, height: int, width: int) -> Image.Image:
    """The pipeline's one resize of a condition image: converted to RGBA (RGB gains alpha 255), then
    resized to (height, width) with Lanczos, as VaeImageProcessor.resize does."""
    if image.mode != "RGBA":
        image = image.convert("RGBA")
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def condition_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """The VAE encoder's input for a condition image: [1, 4, H, W] float32 in [-1, 1], all four channels."""
    rgba = np.asarray(condition_rgba(image, height, width)).astype(np.float32) / 255.0
    return torch.from_numpy(rgba.transpose(2, 0, 1)[None].copy()) * 2.0 - 1.0


def vision_image(image: Image.Image, height: int, width: int) -> Image.Image:
    """The vision encoder's copy: the resized RGBA image composited over white (as the checkpoint was trained);
    only this copy loses the alpha."""
    rgba = condition_rgba(image, height, width)
    white = Image.new("RGB", rgba.size, (255, 255, 255))
    white.paste(rgba, mask=rgba.getchannel("A"))
    return white


def to_images(pixels: torch.Tensor) -> list[Image.Image]:
    """Decoder output [B, 4, H, W] in [-1, 1] -> RGBA PIL images, as VaeImageProcessor.postprocess does."""
    x = (pixels.detach().float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in (x * 255).round().astype("uint8")]


# --------------------------------------------------------------------------------------------- latents

def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h*w, C]: one token per latent pixel, row-major (the pipeline's _pack_latents)."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens of an output size -> [B, C, H/16, W/16] (the pipeline's _unpack_latents, less its frame axis)."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, height // VAE_SCALE, width // VAE_SCALE)


def initial_noise(seed: int, z_dim: int, height: int, width: int) -> torch.Tensor:
    """Packed float32 noise [1, (H/16)(W/16), z_dim], drawn as the pipeline draws it for a CPU generator
    seeded with `seed`: randn((1, 1, z, H/16, W/16)), then packed."""
    if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE:
        raise ConfigError(f"output size {height}x{width} is not a multiple of {SIZE_MULTIPLE}")
    gen = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, 1, z_dim, height // VAE_SCALE, width // VAE_SCALE), generator=gen, dtype=torch.float32)
    return pack(noise[:, 0])


def target_slots(height: int, width: int) -> int:
    """Slots the pipeline appends to the image-pad mask for the target: one per 2x2 group of target tokens."""
    return image_seq_len(height, width) // 4
