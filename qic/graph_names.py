"""Graph names: the build writes them into the manifest and the runtime looks graphs up by them."""

from __future__ import annotations


def graph_name(component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1) -> str:
    """denoiser@HxW@L<bucket>[@nocfg][@B<batch>], text_encoder@L<bucket>[@B<batch>], vae_decoder@HxW[@B<batch>]
    (bucket 0: Lexact). Batch 1 has no suffix: its names predate batched graphs."""
    name = component
    if resolution is not None:
        name += "@{}x{}".format(*resolution)
    if bucket is not None:
        name += f"@L{bucket or 'exact'}"
    if not cfg:
        name += "@nocfg"
    if batch != 1:
        name += f"@B{batch}"
    return name
