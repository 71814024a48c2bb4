"""Initial noise and 2x2 latent packing, laid out exactly as diffusers' QwenImagePipeline does."""

from __future__ import annotations

import torch

from qic.errors import ConfigError


def check_resolution(height: int, width: int, vae_scale_factor: int) -> None:
    """Packing 2x2 over a latent 1/scale the image size needs multiples of 2*scale."""
    multiple = 2 * vae_scale_factor
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        raise ConfigError(
            f"resolution {height}x{width} is not a multiple of {multiple} "
            f"(twice the VAE scale factor {vae_scale_factor})")


def packed_grid(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """(rows, cols) of packed latent tokens for an image of height x width pixels."""
    check_resolution(height, width, vae_scale_factor)
    return height // vae_scale_factor // 2, width // vae_scale_factor // 2


def initial_noise(seed: int, z_dim: int, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
    """Packed float32 noise [1, rows*cols, 4*z_dim], drawn as diffusers draws it for `seed`.

    diffusers draws randn((B, 1, z, H/sf, W/sf)) from a CPU generator and packs it; drawing the same
    way lets a user reproduce a diffusers image from its seed.
    """
    rows, cols = packed_grid(height, width, vae_scale_factor)
    gen = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, 1, z_dim, 2 * rows, 2 * cols), generator=gen, dtype=torch.float32)
    return pack(noise[:, 0])


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 2r, 2c] -> [B, r*c, 4C]: each 2x2 patch becomes one token (channel-major inside)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of pack: [B, r*c, 4C] -> [B, C, 2r, 2c]."""
    b, _, ch = tokens.shape
    x = tokens.view(b, rows, cols, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, 2 * rows, 2 * cols)
