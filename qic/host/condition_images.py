"""Condition images on the host, as the Qwen-Image family's pipelines size and read them (Edit Plus and 2.1 alike):
the area-and-aspect sizing both use, Qwen-VL's image-processor resize as a patch grid, and reading an image file
so that a missing, corrupt or truncated one is one line naming it; and what a program that reads them returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from qic.errors import ConfigError


@dataclass
class ConditionedResult:
    """One image a program with condition images drew (qic.runtime.programs' Result)."""
    image: Image.Image
    request: object
    timings: dict = field(default_factory=dict)
    bucket: int = 0
    # the condition images' sizes as run ("320x320, 288x352"; what the PNG's text records), with a note per image
    # fitted to the nearest built size
    conditions: str | None = None


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """(height, width) of about `target_area` pixels at aspect `ratio` = w/h, each side rounded (Python's
    round: halves to even) to a multiple of 32. The pipeline's calculate_dimensions returns (w, h)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(height / 32) * 32, round(width / 32) * 32


def vision_grid(height: int, width: int, patch_size: int = 16, merge_size: int = 2,
                min_pixels: int = 65536, max_pixels: int = 16777216) -> tuple[int, int]:
    """A Qwen-VL image processor on a condition image of (height, width) (smart_resize: multiples of
    patch*merge, pixel count clamped): its (grid_h, grid_w) in patches. The text holds
    grid_h*grid_w/merge**2 <|image_pad|> tokens for it. The defaults are Qwen3-VL's published
    preprocessor_config.json (size shortest_edge 65536, longest_edge 16777216, patch 16, merge 2); Qwen2.5-VL's
    (the Edit models') are patch 14, merge 2, min_pixels 3136, max_pixels 12845056: pass the checkpoint's."""
    factor = patch_size * merge_size
    if max(height, width) / min(height, width) > 200:
        raise ConfigError(f"condition image {height}x{width}: aspect ratio above 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h // patch_size, w // patch_size


def as_list(values) -> list:
    """A request's image field as a list: one path or image, or a sequence of them (None: none)."""
    if values is None:
        return []
    return [values] if isinstance(values, (str, Path, Image.Image)) else list(values)


def loaded(value) -> Image.Image:
    """An image field's item decoded: a path read now (open_image), a decoded image as it is."""
    return value if isinstance(value, Image.Image) else open_image(Path(value))


def open_image(path: Path) -> Image.Image:
    """The image file decoded now (a truncated file fails here, not halfway through a run): one line naming the
    file when it is missing or not a readable image."""
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except FileNotFoundError:
        raise ConfigError(f"{path}: condition image not found") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable image ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None


def rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' processor makes it: RGBA (and other modes with alpha) composited over white."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    white.alpha_composite(rgba)
    return white.convert("RGB")


def vae_pixels(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """A Qwen-Image VAE encoder's input, [1, 3, H, W] float32 in [-1, 1]: Lanczos resize to `size` (height, width),
    as the pipelines' VaeImageProcessor.preprocess does (the edit pipelines' condition images, img2img's image)."""
    h, w = size
    x = np.asarray(rgb(image).resize((w, h), Image.Resampling.LANCZOS)).astype(np.float32) / 255.0
    return torch.from_numpy(x.transpose(2, 0, 1)[None].copy()) * 2.0 - 1.0


def mask_pixels(mask: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """An inpaint mask as the pipeline's mask processor reads it, [1, 1, H, W] float32 of 0 and 1 (1: repaint):
    Lanczos resize to `size` (height, width), then grayscale, scaled to [0, 1] and binarised at 0.5."""
    h, w = size
    x = np.asarray(mask.resize((w, h), Image.Resampling.LANCZOS).convert("L")).astype(np.float32) / 255.0
    return torch.from_numpy((x >= 0.5).astype(np.float32))[None, None]
