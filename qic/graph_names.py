"""Graph names: the build writes them into the manifest and the runtime looks graphs up by them."""

from __future__ import annotations


def graph_name(component: str, resolution=None, bucket=None, cfg: bool = True) -> str:
    """denoiser@HxW@L<bucket>[@nocfg], text_encoder@L<bucket>, vae_decoder@HxW (bucket 0: Lexact)."""
    name = component
    if resolution is not None:
        name += "@{}x{}".format(*resolution)
    if bucket is not None:
        name += f"@L{bucket or 'exact'}"
    if not cfg:
        name += "@nocfg"
    return name
