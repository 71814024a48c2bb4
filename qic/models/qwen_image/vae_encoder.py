"""Single-frame encoder of Qwen-Image's VAE (diffusers' AutoencoderKLQwenImage), as a 2D network: the Edit
pipelines' condition latents.

The decoder's reduction to 2D (qic/models/qwen_image/vae_decoder.py) holds for the encoder too: diffusers encodes
the first frame alone with an empty feature cache, so each causal 3D convolution meets the frame only through its
kernel's last temporal slice, and a 'downsample3d' block on that first chunk only fills its cache slot and skips
its `time_conv` (dropped from the state dict here), doing exactly what 'downsample2d' does: pad one zero row and
column at the bottom and right, then a stride-2 3x3 convolution.

Output as the Edit pipelines read it: the posterior's mode (`sample_mode="argmax"`: the first z_dim channels of
quant_conv's output, the log-variance never used), normalised `(mu - mean) / std` with the config's statistics,
then packed 2x2 into tokens as `_pack_latents` does. img2img and inpaint draw a posterior sample instead
(`retrieve_latents`' default): given the standard normal noise, the module samples with the log-variance half. The
module is built for one static image size.

attn_scales: diffusers' encoder calls each down block with its feature cache, which its attention block does not
take, so a config with attention in the down blocks cannot run there; qic refuses it rather than run arithmetic no
reference checks (the published config has none).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.host.latents import pack
from qic.models.qwen_image.vae_decoder import (
        MidBlock,
    ResidualBlock,
    RMSNorm2d,
    VAEConfig,
    conv3x3,
    sized_with_stats,
    vae_half_state_dict,
)


class Downsampler(nn.Module):
    """diffusers' Resample('downsample2d', or 'downsample3d' on the first frame): names resample.1.*."""

    def __init__(self, dim: int):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x)


class Encoder2d(nn.Module):
    """diffusers' QwenImageEncoder3d at T=1 with z_dim * 2 outputs (mean and log-variance), its submodule names
    kept so the checkpoint's encoder.* loads strict. down_blocks is one flat list, as there: per level
    num_res_blocks residual blocks, then a downsampler except after the last level."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = conv3x3(cfg.input_channels, dims[0])
        if cfg.attn_scales:
            raise ConfigError(f"vae config sets attn_scales={list(cfg.attn_scales)}: diffusers' encoder cannot run "
                              "attention in its down blocks, so qic implements none")
        layers: list[nn.Module] = []
        for level, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                layers.append(ResidualBlock(cin, cout))
                cin = cout
            if level != len(cfg.dim_mult) - 1:
                layers.append(Downsampler(cout))
        self.down_blocks = nn.ModuleList(layers)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm2d(dims[-1])
        self.conv_out = conv3x3(dims[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for layer in self.down_blocks:
            x = layer(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class QwenVAEEncoder(nn.Module):
    """Image [B, C, H, W] in [-1, 1] -> packed, normalised latents [B, (H/sf/2)(W/sf/2), 4z], fp32.

    `encode(image)` returns the unpacked normalised latents [B, z, H/sf, W/sf] instead.
    """

    def __init__(self, config: VAEConfig, height: int, width: int):
        super().__init__()
        sized_with_stats(self, config, height, width)
        self.encoder = Encoder2d(config)
        self.quant_conv = nn.Conv2d(2 * config.z_dim, 2 * config.z_dim, 1)

    def encode(self, image: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """noise None: the posterior's mode (the edit pipelines'); else a sample of it with that standard normal
        noise [B, z, H/sf, W/sf] (img2img's and inpaint's retrieve_latents: mean + exp(logvar / 2) * noise, the
        log-variance clamped to [-30, 20] as diffusers' DiagonalGaussianDistribution)."""
        moments = self.quant_conv(self.encoder(image.float()))
        z = self.config.z_dim
        latents = moments[:, :z]
        if noise is not None:
            latents = latents + torch.exp(0.5 * moments[:, z:].clamp(-30.0, 20.0)) * noise
        return (latents - self.latents_mean) / self.latents_std

    def forward(self, image: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        return pack(self.encode(image, noise))


def vae_encoder_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint VAE tensors -> QwenVAEEncoder's state_dict, fp32: encoder.* and quant_conv.*, made 2D as the
    decoder's are (vae_half_state_dict; a downsample3d's time_conv is unused on one frame)."""
    return vae_half_state_dict(mapping, ("encoder.", "quant_conv."))
