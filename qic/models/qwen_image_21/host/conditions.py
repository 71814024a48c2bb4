"""Qwen-Image-2.1's condition (reference) images on the host, as QwenImage21Pipeline reads them: each image
converted to RGBA and resized once to the condition size its aspect gives at `output_resolution`**2 pixels; the VAE
encoder graph reads all four channels, the vision graph a copy composited over white (resized, normalised and
patchified as the checkpoint's image processor does). Encoded once per request: both CFG branches read the same
features and latents. The sizes must be among the bundle's (`qic build --condition-size`), each one graph pair.

Host code only (no nn.Module): the runtime imports it with the family's host program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from PIL import Image

from qic.errors import ConfigError
from qic.host.condition_images import as_list, loaded
from qic.host.vl_processor import vision_pixels
from qic.models.qwen_image_21.host.sampling import VAE_SCALE, condition_pixels, condition_size, vision_image
from qic.models.qwen_image_21.host.sequence import SLOT_TOKENS


@dataclass
class Conditions:
    """A request's condition images, encoded: what the text-encoder, prefill and sequence code read."""
    grids: list[tuple[int, int]]               # each image's latent grid (H/16, W/16), in prompt order
    vision_grids: list[tuple[int, int, int]]   # each image's (1, gh, gw) in vision patches (the processor's grid)
    embeds: torch.Tensor       # [slots, hidden]: the vision graphs' merged features in order, zero rows after
    deepstack: torch.Tensor    # [k, slots, hidden]: likewise
    latents: torch.Tensor      # [1, 4 slots, z]: the VAE encoder's normalised tokens in order, zero rows after
    slots: int                 # the bundle's capacity in image slots (the images graphs' static size)
    used_slots: int            # the slots these images fill
    image_token_id: int
    merge_size: int


def read_images(values, conditions: dict) -> list[Image.Image]:
    """The request's images (file paths or PIL images), checked against what the bundle was built for: none
    without condition sizes, at most `--condition-images`; a file that is no readable image is one line naming it."""
    if not values:
        return []
    values = as_list(values)
    if not conditions.get("sizes"):
        raise ConfigError("this bundle was built without condition images",
                          "rebuild with --condition-size HxW (and --condition-images N), or drop --image")
    if len(values) > conditions["images"]:
        raise ConfigError(f"{len(values)} condition images; this bundle takes at most {conditions['images']}",
                          f"rebuild with --condition-images {len(values)}, or give fewer --image")
    return [loaded(v) for v in values]


def condition_sizes(images: list[Image.Image], conditions: dict, output_resolution: int,
                    nearest: bool = False) -> tuple[list[tuple[int, int]], list[str]]:
    """Each image's condition size as the pipeline resizes it (its aspect at output_resolution**2 pixels), which
    must be one the bundle was built for: else one line naming the built sizes, unless `nearest` asks for the built
    size nearest its aspect (then by area). Also a note per image fitted so ("image 2: 192x544 -> 288x352")."""
    built = [tuple(s) for s in conditions["sizes"]]
    sizes, fitted = [], []
    for i, img in enumerate(images):
        h, w = condition_size(img.height, img.width, output_resolution)
        if (h, w) not in built and nearest:
            near = min(built, key=lambda s: (abs(math.log((s[1] / s[0]) / (w / h))), abs(s[0] * s[1] - h * w)))
            fitted.append(f"image {i + 1}: {h}x{w} -> {near[0]}x{near[1]}")
            h, w = near
        if (h, w) not in built:
            raise ConfigError(
                f"condition image {i + 1} ({img.width}x{img.height} pixels) resizes to {h}x{w} at output_resolution "
                f"{output_resolution}; this bundle holds condition sizes {', '.join(f'{a}x{b}' for a, b in built)}",
                f"rebuild with --condition-size {h}x{w}, give an image of a built size's aspect, or pass "
                "--nearest-condition-size")
        sizes.append((h, w))
    return sizes, fitted


def vision_grids(conditions: dict, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Each condition size's (1, gh, gw) in vision patches: the grid the processor gives it (the build checked that
    its resize keeps the size), what the text's <|image_pad|> runs and the mRoPE positions count."""
    patch = conditions["processor"]["patch_size"]
    return [(1, h // patch, w // patch) for h, w in sizes]


def encode_conditions(model, images: list[Image.Image], sizes: list[tuple[int, int]]) -> Conditions:
    """Each image through the bundle's vae_encoder and vision graphs at its condition size (condition_sizes), padded
    to the capacity the images graphs were built for."""
    cond = model.manifest["conditions"]
    proc = cond["processor"]
    grids = vision_grids(cond, sizes)
    embeds, deep, latents = [], [], []
    for img, (h, w), (_, gh, gw) in zip(images, sizes, grids):
        if img.mode != "RGBA":
            img = img.convert("RGBA")
        (tokens,) = model.graph("vae_encoder", (h, w))(condition_pixels(img, h, w))
        e, d = model.graph("vision", (h, w))(vision_pixels(vision_image(img, h, w), (gh, gw), proc["patch_size"],
                                                            proc["image_mean"], proc["image_std"]))
        latents.append(tokens[0])
        embeds.append(e)
        deep.append(d)
    used = sum(e.shape[0] for e in embeds)
    slots = cond["slots"]
    if used > slots:   # sizes and count are checked above, so only a bundle whose manifest lies gets here
        raise ConfigError(f"the condition images fill {used} image slots; the bundle's graphs hold {slots}")
    embeds_t = torch.cat(embeds)
    deep_t = torch.cat(deep, dim=1)
    lat = torch.cat(latents)
    return Conditions(
        [(h // VAE_SCALE, w // VAE_SCALE) for h, w in sizes], grids,
        torch.cat([embeds_t, embeds_t.new_zeros(slots - used, embeds_t.shape[1])]),
        torch.cat([deep_t, deep_t.new_zeros(deep_t.shape[0], slots - used, deep_t.shape[2])], dim=1),
        torch.cat([lat, lat.new_zeros(SLOT_TOKENS * slots - lat.shape[0], lat.shape[1])])[None],
        slots, used, cond["image_token_id"], proc["merge_size"])
