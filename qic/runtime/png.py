"""PNG output with the generation settings as text chunks, written atomically and reproducibly."""

from __future__ import annotations

import io
from pathlib import Path

from PIL.PngImagePlugin import PngInfo

from qic.fsutil import write_bytes_atomic


def save_png(result, bundle_id: str, path: str | Path, weights_id: str | None = None) -> Path:
    path = Path(path)
    write_bytes_atomic(path, png_bytes(result, bundle_id, weights_id))
    return path


def png_bytes(result, bundle_id: str, weights_id: str | None = None) -> bytes:
    """The PNG file's bytes: the same for the same image and settings, whoever writes or sends them."""
    req = result.request
    info = PngInfo()
    # The settings the host program's request has (a family's Request may lack some; text-to-image has all).
    given = {k: getattr(req, k) for k in ("prompt", "negative_prompt", "seed", "steps", "guidance") if hasattr(req, k)}
    if getattr(req, "strength", None) is not None:   # img2img: how far from its image
        given["strength"] = req.strength
    given["bundle"] = bundle_id
    if hasattr(req, "height"):
        given["resolution"] = f"{req.height}x{req.width}"
    for key, value in given.items():
        info.add_itxt(key, "" if value is None else str(value))
    if weights_id:
        info.add_itxt("weights", weights_id)
    if getattr(req, "lora", None):   # per-request adapters (qic.runtime.lora): NAME:SCALE each, in slot order
        info.add_itxt("lora", ", ".join(f"{name}:{scale:g}" for name, scale in req.lora))
    if getattr(result, "conditions", None):   # reference images: the sizes they ran at (a fit to the nearest noted)
        info.add_itxt("conditions", result.conditions)
    if getattr(result, "computed", None) is not None:   # step caching: its settings, the steps each branch computed
        from qic.host.cache_policy import computed_line
        info.add_itxt("step_cache", f"{req.cache.describe()}; computed: {computed_line(result.computed, req.steps)}")
    buf = io.BytesIO()
    result.image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def step_cache_of(png: bytes) -> str | None:
    """The step_cache text chunk of a PNG png_bytes wrote (None without one, or for bytes that are no PNG):
    what a server logs per image. Reads the chunks before the pixels only."""
    from PIL import Image
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    return Image.open(io.BytesIO(png)).text.get("step_cache")
