"""Single-frame decoder of Qwen-Image's VAE (diffusers' AutoencoderKLQwenImage), as a 2D network.

The checkpoint's VAE is WAN's causal 3D VAE. Decoding one frame (T=1) it collapses exactly to 2D:
- A causal conv pads 2*p frames of zeros *before* the frame and none after, so of a k_t=3 kernel only
  the last temporal slice meets real data; a k_t=1 kernel is its own last slice. Each CausalConv3d is
  therefore a Conv2d whose weight is `w3d[:, :, -1]` (with the same spatial padding).
- diffusers decodes frame by frame with a feature cache; for the first (here: only) frame every cache
  slot is empty, so no earlier frame leaks in.
- 'upsample3d' blocks: on the first frame diffusers only marks their cache slot ("Rep") and skips
  `time_conv`, so they do exactly what 'upsample2d' does. Their time_conv tensors are never used and
  `vae_decoder_state_dict` drops them.
- Attention and RMS norms act per frame already.

Packing convention (diffusers' pipeline `_pack_latents`/`_unpack_latents`): latents [B, z, h, w] with
h = H/sf, w = W/sf are cut into 2x2 patches; token (i, j) = row-major over the (h/2, w/2) grid, and its
4*z features are ordered (channel, dy, dx) with dx fastest. The module is built for one static image
size: `QwenVAEDecoder(config, height, width)`; one instance per resolution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.host.latents import unpack
from qic.models.common import check_config_keys

COMPONENT = "vae"


@dataclass(frozen=True)
class VAEConfig:
    base_dim: int
    z_dim: int
    dim_mult: tuple[int, ...]
    num_res_blocks: int
    temperal_downsample: tuple[bool, ...]  # diffusers' spelling, kept so keys match config.json
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    attn_scales: tuple[float, ...] = ()  # used by the encoder only: diffusers' decoder ignores it
    dropout: float = 0.0  # inference: no effect
    input_channels: int = 3  # image channels (the decoder's output)

    @property
    def scale_factor(self) -> int:
        # diffusers' vae_scale_factor / spatial_compression_ratio
        return 2 ** len(self.temperal_downsample)

    @classmethod
    def from_dict(cls, d: Mapping) -> "VAEConfig":
        names = [f.name for f in fields(cls)]
        check_config_keys(d, names, COMPONENT)
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{COMPONENT} config lacks required keys: {', '.join(missing)}")
        cfg = cls(
            base_dim=int(d["base_dim"]),
            z_dim=int(d["z_dim"]),
            dim_mult=tuple(int(m) for m in d["dim_mult"]),
            num_res_blocks=int(d["num_res_blocks"]),
            temperal_downsample=tuple(bool(t) for t in d["temperal_downsample"]),
            latents_mean=tuple(float(v) for v in d["latents_mean"]),
            latents_std=tuple(float(v) for v in d["latents_std"]),
            attn_scales=tuple(float(s) for s in d.get("attn_scales", ())),
            dropout=float(d.get("dropout", 0.0)),
            input_channels=int(d.get("input_channels", 3)),
        )
        if len(cfg.latents_mean) != cfg.z_dim or len(cfg.latents_std) != cfg.z_dim:
            raise ConfigError(f"{COMPONENT} config: latents_mean/latents_std must have z_dim={cfg.z_dim} entries")
        # diffusers builds len(dim_mult)-1 upsamplers but derives the scale factor from temperal_downsample;
        # they only agree when the lengths match.
        if len(cfg.temperal_downsample) != len(cfg.dim_mult) - 1:
            raise ConfigError(f"{COMPONENT} config: temperal_downsample needs len(dim_mult)-1 = "
                              f"{len(cfg.dim_mult) - 1} entries, has {len(cfg.temperal_downsample)}")
        return cfg


# ---------------------------------------------------------------------------------------------- packing

# ----------------------------------------------------------------------------------------------- layers

class RMSNorm2d(nn.Module):
    """diffusers' QwenImage RMS_norm over channels (dim 1): F.normalize * sqrt(C) * gamma, no bias."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1))  # checkpoint's (C,1,1,1) reshaped for 2D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.normalize (x / max(||x||, 1e-12)) rather than rsqrt(mean): same eps behaviour as the reference
        return F.normalize(x, dim=1) * self.scale * self.gamma


def conv3x3(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNorm2d(cin)
        self.conv1 = conv3x3(cin, cout)
        self.norm2 = RMSNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        # only present when the width changes, as in the checkpoint
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.conv_shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over all h*w positions, head dim = channels."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm2d(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, 3 * c, h * w).transpose(-1, -2)  # [b, 1, hw, 3c]
        q, k, v = qkv.chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)  # [b, 1, hw, c]
        o = o.transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj(o)


class NearestUp2x(nn.Module):
    """2x nearest upsampling. diffusers uses 'nearest-exact', which at an integer factor 2 picks source
    index dst // 2, i.e. plain repetition; written as expand+reshape so every backend lowers it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return x[:, :, :, None, :, None].expand(b, c, h, 2, w, 2).reshape(b, c, 2 * h, 2 * w)


class Upsampler(nn.Module):
    """diffusers' Resample('upsample2d' or, at T=1, 'upsample3d'): up 2x, then conv to half the channels."""

    def __init__(self, dim: int):
        super().__init__()
        self.resample = nn.Sequential(NearestUp2x(), conv3x3(dim, dim // 2))  # names: resample.1.*

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x)


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        # diffusers builds the decoder mid block with num_layers=1 always: resnet, attention, resnet
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Upsampler(cout)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in self.resnets:
            x = r(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Decoder2d(nn.Module):
    """diffusers' QwenImageDecoder3d at T=1; same submodule names so state_dict keys match the checkpoint."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.base_dim * m for m in (mult[-1], *mult[::-1])]
        self.conv_in = conv3x3(cfg.z_dim, dims[0])
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i in range(len(mult)):
            cin = dims[i] if i == 0 else dims[i] // 2  # every upsampler before this block halved the width
            blocks.append(UpBlock(cin, dims[i + 1], cfg.num_res_blocks, upsample=i != len(mult) - 1))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm2d(dims[-1])
        self.conv_out = conv3x3(dims[-1], cfg.input_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(x))
        for blk in self.up_blocks:
            x = blk(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ------------------------------------------------------------------------------------------------ model

def sized_with_stats(module: nn.Module, config: VAEConfig, height: int, width: int) -> None:
    """One half of the VAE built for one image size: the size checked against the 2x2 packing of the latent grid,
    and the latent statistics held as buffers (from config.json, not the weights file: out of state_dict)."""
    step = 2 * config.scale_factor  # 2x2 packing of a latent grid 1/sf the image size
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ConfigError(f"image size {height}x{width} is not a positive multiple of {step} "
                          f"(VAE scale factor {config.scale_factor} times the 2x2 latent packing)")
    module.config = config
    module.height, module.width = height, width
    stat = dict(dtype=torch.float32)
    module.register_buffer("latents_mean", torch.tensor(config.latents_mean, **stat).view(1, -1, 1, 1),
                           persistent=False)
    module.register_buffer("latents_std", torch.tensor(config.latents_std, **stat).view(1, -1, 1, 1),
                           persistent=False)


class QwenVAEDecoder(nn.Module):
    """Packed, normalised latents [B, (H/sf/2)(W/sf/2), 4z] -> image [B, C, H, W] in [-1, 1], fp32.

    Built for one (height, width) in pixels: unpacking needs the latent grid statically.
    `decode(z)` takes unpacked normalised latents [B, z, h, w] instead.
    """

    def __init__(self, config: VAEConfig, height: int, width: int):
        super().__init__()
        sized_with_stats(self, config, height, width)
        self.post_quant_conv = nn.Conv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder2d(config)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        # diffusers divides by 1/std; multiplying by std is the same map (differs only by fp32 rounding)
        z = z.float() * self.latents_std + self.latents_mean
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)

    def forward(self, packed_latents: torch.Tensor) -> torch.Tensor:
        sf = self.config.scale_factor
        return self.decode(unpack(packed_latents, self.height // sf // 2, self.width // sf // 2))


# -------------------------------------------------------------------------------------------- weights

def vae_decoder_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint VAE tensors (diffusers names, 3D kernels) -> QwenVAEDecoder's state_dict, fp32: decoder.* and
    post_quant_conv.* (vae_half_state_dict)."""
    return vae_half_state_dict(mapping, ("decoder.", "post_quant_conv."))


def vae_half_state_dict(mapping: Mapping[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint VAE tensors under `prefixes` (one half of the autoencoder), made 2D, fp32.

    Drops the temporal resamplers' time_conv tensors (unused at T=1, see the module docstring). 5D conv kernels
    become their last temporal slice; RMS-norm gammas become (C, 1, 1). Only the kept names are read, so a lazy
    mapping loads nothing else. Missing tensors are left for load_weights to name.
    """
    out = {}
    for name in mapping.keys():
        if not name.startswith(prefixes) or ".time_conv." in name:
            continue
        t = mapping[name]
        if name.endswith(".gamma"):
            t = t.reshape(-1, 1, 1)
        elif t.dim() == 5:
            t = t[:, :, -1]  # causal padding: only the last temporal slice meets the frame
        out[name] = t.float().contiguous()
    return out
