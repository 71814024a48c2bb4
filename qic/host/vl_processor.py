"""A Qwen-VL image processor's settings, as a checkpoint's processor folder states them, and what it does to a
condition image (host side): both Qwen-Image families' condition images go through one.

The pipelines' processors (transformers' Qwen2VLProcessor for Qwen-Image's Edit models, Qwen3VLProcessor for
2.1) read their image processor's settings from
`preprocessor_config.json`, or, as newer transformers save it, from the `image_processor` entry of
`processor_config.json`: the patch and merge sizes, the smart-resize pixel bounds (`size.shortest_edge` /
`size.longest_edge`, or the older `min_pixels` / `max_pixels`) and the normalisation. qic reads the same files at
build time and records the result in the bundle's manifest, so the runtime resizes and normalises a condition image
as the pipeline does without transformers. Absent both files, the family's published settings apply (its
`defaults`: Qwen3-VL's for 2.1, whose own processor files were not found, docs/design.md; Qwen2.5-VL's for the
Edit models).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from qic.errors import ConfigError

FILES = ("preprocessor_config.json", "processor_config.json")
# Qwen3-VL's published preprocessor_config.json (its normalisation, mean = std = 0.5, is not the processor class's
# default, CLIP's)
QWEN3_VL = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 65536,
            "max_pixels": 16777216, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
# Qwen2.5-VL's published preprocessor_config.json (the Edit models' processor folder): patch 14, CLIP's
# normalisation, 56*56 to 28*28*16384 pixels
QWEN2_5_VL = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136,
              "max_pixels": 12845056, "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711]}


def vision_pixels(image, grid: tuple[int, int], patch_size: int, mean, std) -> torch.Tensor:
    """An RGB PIL image -> the normalised [3, gh * patch, gw * patch] float32 image the processor patchifies
    (grid (gh, gw) from qic.host.condition_images.vision_grid; the vision graph patchifies it): PIL bicubic resize
    of the uint8 image, scaled by 1/255, then (x - mean) / std per channel, as Qwen2VLImageProcessorPil does."""
    from PIL import Image
    gh, gw = grid
    resized = image.convert("RGB").resize((gw * patch_size, gh * patch_size), Image.Resampling.BICUBIC)
    x = np.asarray(resized).astype(np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray(x))


def image_processor_settings(folder: Path, defaults: dict) -> dict:
    """The settings above from `folder` (the checkpoint's processor folder), `defaults` for what it does not say;
    a file that is not a JSON mapping, or a value of the wrong kind, is one line naming the file and key."""
    for name in FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot be read as JSON ({type(e).__name__})") from None
        if name == "processor_config.json":
            raw = raw.get("image_processor") if isinstance(raw, dict) else None
            if raw is None:
                continue
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON mapping of the image processor's settings")
        return _settings(raw, path, defaults)
    return dict(defaults)


def _settings(raw: dict, path: Path, defaults: dict) -> dict:
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    out = {
        "patch_size": raw.get("patch_size", defaults["patch_size"]),
        "merge_size": raw.get("merge_size", defaults["merge_size"]),
        "temporal_patch_size": raw.get("temporal_patch_size", defaults["temporal_patch_size"]),
        "min_pixels": size.get("shortest_edge", raw.get("min_pixels", defaults["min_pixels"])),
        "max_pixels": size.get("longest_edge", raw.get("max_pixels", defaults["max_pixels"])),
        "image_mean": raw.get("image_mean", defaults["image_mean"]),
        "image_std": raw.get("image_std", defaults["image_std"]),
    }
    for key in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
            raise ConfigError(f"{path}: {key} must be a positive integer, got {out[key]!r}")
    for key in ("image_mean", "image_std"):
        value = out[key]
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ConfigError(f"{path}: {key} must be a list of three numbers (R, G, B), got {value!r}")
        out[key] = [float(v) for v in value]
    if any(v == 0 for v in out["image_std"]):
        raise ConfigError(f"{path}: image_std holds a zero (the normalisation divides by it)")
    return out
