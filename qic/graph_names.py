"""Graph names: the build writes them into the manifest and the runtime looks graphs up by them."""

from __future__ import annotations


def graph_name(component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
               part: str | None = None, rows: int | None = None) -> str:
    """denoiser@HxW@L<bucket>[@nocfg][@<part>[@R<rows>]][@B<batch>], text_encoder@L<bucket>[@B<batch>],
    vae_decoder@HxW[@B<batch>] (bucket 0: Lexact). Batch 1 has no suffix: its names predate batched graphs.
    part: a step-caching part of the step (head, rest, mid, tail; qic/models/qwen_image/step_cache.py); rows: a
    middle graph over that many rows instead of all of them."""
    name = component
    if resolution is not None:
        name += "@{}x{}".format(*resolution)
    if bucket is not None:
        name += f"@L{bucket or 'exact'}"
    if not cfg:
        name += "@nocfg"
    if part is not None:
        name += f"@{part}" + (f"@R{rows}" if rows is not None else "")
    if batch != 1:
        name += f"@B{batch}"
    return name
