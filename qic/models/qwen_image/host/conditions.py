"""Qwen-Image Edit's condition images on the host, as QwenImageEditPlusPipeline (Edit Plus: 2509, 2511) and
QwenImageEditPipeline (Edit, "v1") size and read them.

Each condition image is used twice. The VAE side: resized
from the original at its aspect (calculate_dimensions: about an area, sides multiples of 32) to 1024*1024 pixels,
the encoder's input, whose latent tokens follow the noise in the denoiser's sequence. The vision side, which the
processor resizes again to its patch grid (smart_resize) and whose vision-tower features fill the prompt's
<|image_pad|> tokens: Edit Plus resizes the original to 384*384 pixels at its aspect; Edit hands the processor its
VAE-side image. A bundle holds graphs per condition size, VAE side (`--condition-size`); the vision grid is the one
an image of that size's aspect gets, so an image whose vision grid differs (aspects that round to one VAE size but
not to one vision size) is refused like one of an unbuilt size, unless the request asks for the nearest built size.

Host code only (no nn.Module): the runtime imports it with the family's host program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from PIL import Image

from qic.errors import ConfigError
from qic.host.condition_images import as_list, calculate_dimensions, loaded, rgb, vision_grid
from qic.host.vl_processor import vision_pixels

VAE_AREA = 1024 * 1024      # the pipeline's VAE_IMAGE_SIZE
VISION_AREA = 384 * 384     # its CONDITION_IMAGE_SIZE
# A model may record its own two areas (qic.spec.condition_areas: the trained shapes-edit model's 128*128): the
# manifest's conditions.areas then, and the graph shapes' vision_area.
LATENT_PATCH = 16           # pixels per condition latent token: the 8x VAE, packed 2x2


@dataclass(frozen=True)
class Sized:
    """One condition image as a request runs it."""
    vae: tuple[int, int]        # the VAE-side size (a built condition size)
    vision: tuple[int, int]     # the vision-side size before the processor's resize
    grid: tuple[int, int]       # the processor's grid in patches


def vision_side(height: int, width: int, area: int = VISION_AREA) -> tuple[int, int]:
    return calculate_dimensions(area, width / height)


def vae_side(height: int, width: int, area: int = VAE_AREA) -> tuple[int, int]:
    return calculate_dimensions(area, width / height)


def areas(conditions: dict) -> tuple[int, int]:
    """A bundle's (VAE side, vision side) areas: its manifest's, else the pipeline's."""
    vae, vision = conditions.get("areas") or (VAE_AREA, VISION_AREA)
    return int(vae), int(vision)


def grid_of(size: tuple[int, int], proc: dict) -> tuple[int, int]:
    """The processor's patch grid of a vision-side size."""
    return vision_grid(*size, proc["patch_size"], proc["merge_size"], proc["min_pixels"], proc["max_pixels"])


PLUS, V1 = "plus", "v1"   # the two Edit pipelines' ways (the manifest's conditions.edit)


def built_grid(condition_size: tuple[int, int], proc: dict, edit: str = PLUS,
               vision_area: int = VISION_AREA) -> tuple[int, int]:
    """The vision grid a condition size's graphs are built for: that of an image of the size's own aspect."""
    return grid_of(condition_size if edit == V1 else vision_side(*condition_size, vision_area), proc)


def vision_tokens(grid: tuple[int, int], merge: int) -> int:
    return grid[0] * grid[1] // merge ** 2


def latent_tokens(size: tuple[int, int]) -> int:
    return (size[0] // LATENT_PATCH) * (size[1] // LATENT_PATCH)


def slots(sizes, images: int, proc: dict, edit: str = PLUS, vision_area: int = VISION_AREA) -> tuple[int, int]:
    """(vision-token slots, condition latent tokens): the capacity of `images` images of the largest size."""
    if not sizes:
        return 0, 0
    return (images * max(vision_tokens(built_grid(s, proc, edit, vision_area), proc["merge_size"]) for s in sizes),
            images * max(latent_tokens(s) for s in sizes))


def read_images(values, conditions: dict) -> list[Image.Image]:
    """The request's images (paths or PIL images): at least one, at most the bundle's --condition-images; a file
    that is no readable image is one line naming it."""
    values = as_list(values)
    if not values:
        raise ConfigError("an edit bundle needs a condition image", "give --image FILE (repeatable)")
    if len(values) > conditions["images"]:
        raise ConfigError(f"{len(values)} condition images; this bundle takes at most {conditions['images']}",
                          f"rebuild with --condition-images {len(values)}, or give fewer --image")
    return [loaded(v) for v in values]


def size_images(images: list[Image.Image], conditions: dict, nearest: bool = False) -> tuple[list[Sized], list[str]]:
    """Each image's sizes as the pipeline computes them, which must be among the bundle's: else one line naming
    the built sizes, unless `nearest` asks for the built size nearest its aspect (then area); a note per image
    fitted so."""
    built = {tuple(s): tuple(g) for s, g in zip(conditions["sizes"], conditions["grids"])}
    proc, v1 = conditions["processor"], conditions.get("edit") == V1
    vae_area, vision_area = areas(conditions)
    out, fitted = [], []
    for i, img in enumerate(images):
        vae = vae_side(img.height, img.width, vae_area)
        vision = vae if v1 else vision_side(img.height, img.width, vision_area)
        grid = grid_of(vision, proc)
        if (vae not in built or built[vae] != grid) and nearest:
            h, w = vae
            near = min(built, key=lambda s: (abs(math.log((s[1] / s[0]) / (w / h))), abs(s[0] * s[1] - h * w)))
            fitted.append(f"image {i + 1}: {h}x{w} -> {near[0]}x{near[1]}")
            vae, vision = near, near if v1 else vision_side(*near, vision_area)
            grid = built[near]
        if vae not in built:
            raise ConfigError(
                f"condition image {i + 1} ({img.width}x{img.height} pixels) resizes to {vae[0]}x{vae[1]}; this "
                f"bundle holds condition sizes {', '.join(f'{a}x{b}' for a, b in built)}",
                f"rebuild with --condition-size {vae[0]}x{vae[1]}, give an image of a built size's aspect, or pass "
                "--nearest-condition-size")
        if built[vae] != grid:
            raise ConfigError(
                f"condition image {i + 1} ({img.width}x{img.height} pixels): its vision side {vision[0]}x{vision[1]} "
                f"gives a {grid[0]}x{grid[1]} patch grid; the bundle's {vae[0]}x{vae[1]} graphs hold "
                f"{built[vae][0]}x{built[vae][1]}", "give an image of that size's exact aspect, or pass "
                "--nearest-condition-size")
        out.append(Sized(vae, vision, grid))
    return out, fitted


def vision_input(image: Image.Image, sized: Sized, proc: dict) -> torch.Tensor:
    """The vision graph's input: the pipeline's Lanczos resize to the vision side (VaeImageProcessor.resize; Edit's
    is its VAE side),
    then the processor's (bicubic to the grid, rescale, normalise), [3, gh * p, gw * p] float32."""
    h, w = sized.vision
    resized = rgb(image).resize((w, h), Image.Resampling.LANCZOS)
    return vision_pixels(resized, sized.grid, proc["patch_size"], proc["image_mean"], proc["image_std"])
