"""Qwen-Image-2.1's VAE (diffusers' AutoencoderKLQwenImage21) on one frame: an encoder per condition size and a
decoder per output resolution, as plain 2D networks.

The checkpoint's VAE is Wan 2.2's residual causal VAE (64 latent channels, 16x spatial, RGBA in and out). Unlike
Qwen-Image's WAN 2.1 VAE (qic/models/vae_decoder.py) its "causal 3D" convolutions are already stored as 2D
kernels, and on one frame the rest reduces to 2D as well:
- diffusers encodes and decodes a single image as frame 0 with an empty feature cache, so no earlier frame
  exists: the temporal resamplers' `time_conv` never runs (downsample3d only fills its cache slot, upsample3d
  only marks it "Rep") and their tensors are dropped by the state-dict functions below.
- the encoder's averaging shortcut (AvgDown3D) of a temporally downsampling block pads ONE zero frame before
  the image and averages channel groups over the (zero, image) pair: the zeros take part in the mean, so they
  are kept here (`_space_to_channels`), not simplified away.
- the decoder's duplicating shortcut (DupUp3D) of a temporally upsampling block keeps only the last temporal
  phase on the first chunk (`first_chunk=True`), so it picks that phase's channels.
- diffusers clamps the decoded image to [-1, 1]; the encoder's posterior is read at its mode (the pipeline's
  `sample_mode="argmax"`): the first z_dim channels of quant_conv's output.

The pieces shared with the WAN 2.1 decoder (residual block, attention block, nearest 2x up) are the same math,
but the residual blocks' norm gammas are stored (C, 1, 1, 1) here and (C, 1, 1) there after qic's conversion;
this file keeps the checkpoint's shapes so diffusers' state dict loads strict, minus the unused `time_conv`
tensors and the other half of the autoencoder.

Latent normalisation as QwenImage21Pipeline applies it: encode `(mu - mean) / std`, decode `z * std + mean`
(2.1's config stores the std itself, unlike Qwen-Image's 1/std). Tokens are the latents flattened row-major
over the (H/16, W/16) grid, 64 channels each (the 2.1 transformer's patch size is 1): the pipeline's
`_pack_latents` / `_unpack_latents`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from qic.errors import ConfigError
from qic.models.common import check_config_keys

COMPONENT = "vae"

_DEFAULTS = {  # AutoencoderKLQwenImage21's constructor defaults, for keys a config.json leaves out
    "decoder_base_dim": None, "attn_scales": (), "dropout": 0.0, "is_residual": True, "in_channels": 4,
    "out_channels": 4, "patch_size": None, "scale_factor_temporal": 8, "scale_factor_spatial": 16,
}

# The latent statistics diffusers' AutoencoderKLQwenImage21 uses when a config omits them (its __init__ defaults):
# the published Qwen-Image-2.1 vae/config.json has no latents_mean / latents_std, so diffusers normalises the
# latents with these, and so must qic to draw what the pipeline draws. For z_dim 64 only (their length).
PUBLISHED_LATENTS_MEAN = (
    0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177,
    -0.651, 0.2732, 0.7562, -0.6163, -1.0277, 3.8363, 2.021, 0.0472, 0.932, 2.0087,
    2.4954, -0.1391, -1.4249, 1.8464, -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518,
    -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555, 0.0746, -3.0751, -0.1076, 1.7376,
    -1.0914, -1.9435, -0.2784, -1.368, 0.4809, -0.4433, 0.3764, 0.5729, -2.0595, 1.096,
    -1.326, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632,
    0.5547, -1.7121, -0.1562, 0.0304,
)
PUBLISHED_LATENTS_STD = (
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.791, 3.0785, 3.65,
    3.9308, 3.0904, 2.8778, 3.7675, 3.732, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443,
    2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513, 3.9323, 3.4719, 3.7498, 4.283,
    3.5694, 4.2467, 3.9037, 3.2947, 5.077, 3.5075, 3.27, 3.4767, 2.8063, 5.1125,
    3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168,
    3.5643, 4.055, 5.5614, 4.2963, 4.408, 3.4959, 3.8747, 3.7608, 3.5735, 3.149,
    3.7662, 3.6746, 3.4563, 3.8161,
)

@dataclass(frozen=True)
class VAE21Config:
    base_dim: int
    decoder_base_dim: int | None
    z_dim: int
    dim_mult: tuple[int, ...]
    num_res_blocks: int
    temperal_downsample: tuple[bool, ...]  # diffusers' spelling, kept so keys match config.json
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    attn_scales: tuple[float, ...] = ()  # read by the non-residual encoder only, which 2.1 does not use
    dropout: float = 0.0
    is_residual: bool = True
    in_channels: int = 4
    out_channels: int = 4
    patch_size: int | None = None
    scale_factor_temporal: int = 8  # video only
    scale_factor_spatial: int = 16

    @property
    def scale_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)  # one spatial 2x per block but the last

    @property
    def decoder_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @classmethod
    def from_dict(cls, d: Mapping) -> "VAE21Config":
        check_config_keys(d, [f.name for f in fields(cls)], COMPONENT)
        required = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{COMPONENT} config lacks required keys: {', '.join(missing)}")
        g = {**_DEFAULTS, **d}
        for key, published in (("latents_mean", PUBLISHED_LATENTS_MEAN), ("latents_std", PUBLISHED_LATENTS_STD)):
            if key not in d:   # as diffusers: its class defaults, the published statistics (z_dim 64)
                if int(d["z_dim"]) != len(published):
                    raise ConfigError(f"{COMPONENT} config has no {key}, and the published statistics diffusers "
                                      f"falls back to are for z_dim {len(published)}, not {d['z_dim']}",
                                      f"add {key} ({d['z_dim']} values) to vae/config.json")
                g[key] = published
        cfg = cls(
            base_dim=int(g["base_dim"]),
            decoder_base_dim=None if g["decoder_base_dim"] is None else int(g["decoder_base_dim"]),
            z_dim=int(g["z_dim"]),
            dim_mult=tuple(int(m) for m in g["dim_mult"]),
            num_res_blocks=int(g["num_res_blocks"]),
            temperal_downsample=tuple(bool(t) for t in g["temperal_downsample"]),
            latents_mean=tuple(float(v) for v in g["latents_mean"]),
            latents_std=tuple(float(v) for v in g["latents_std"]),
            attn_scales=tuple(float(s) for s in g["attn_scales"]),
            dropout=float(g["dropout"]),
            is_residual=bool(g["is_residual"]),
            in_channels=int(g["in_channels"]),
            out_channels=int(g["out_channels"]),
            patch_size=None if g["patch_size"] is None else int(g["patch_size"]),
            scale_factor_temporal=int(g["scale_factor_temporal"]),
            scale_factor_spatial=int(g["scale_factor_spatial"]),
        )
        cfg._check()
        return cfg

    def _check(self) -> None:
        if not self.is_residual:
            raise ConfigError(f"{COMPONENT} config sets is_residual=false; qic implements 2.1's residual VAE only")
        if self.patch_size not in (None, 1):
            raise ConfigError(f"{COMPONENT} config sets patch_size={self.patch_size}; qic implements the unpatched "
                              "VAE only (patch_size null)")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ConfigError(f"{COMPONENT} config: latents_mean/latents_std must have z_dim={self.z_dim} entries")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ConfigError(f"{COMPONENT} config: temperal_downsample needs len(dim_mult)-1 = "
                              f"{len(self.dim_mult) - 1} entries, has {len(self.temperal_downsample)}")
        if self.scale_factor != self.scale_factor_spatial:
            # diffusers' pipeline uses 16 whatever the config says; a VAE of another factor cannot serve it
            raise ConfigError(f"{COMPONENT} config: dim_mult gives a {self.scale_factor}x VAE but "
                              f"scale_factor_spatial is {self.scale_factor_spatial}")


def check_size(height: int, width: int, scale: int) -> None:
    if height <= 0 or width <= 0 or height % scale or width % scale:
        raise ConfigError(f"image size {height}x{width} is not a positive multiple of the VAE's {scale}x downsampling")


# ----------------------------------------------------------------------------------------------- layers

class RMSNorm2d(nn.Module):
    """Wan's RMS_norm over channels: F.normalize * sqrt(C) * gamma. `shape` is the checkpoint's gamma shape."""

    def __init__(self, dim: int, shape: tuple[int, ...]):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma.view(-1, 1, 1)


def conv3x3(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNorm2d(cin, (cin, 1, 1, 1))
        self.conv1 = conv3x3(cin, cout)
        self.norm2 = RMSNorm2d(cout, (cout, 1, 1, 1))
        self.conv2 = conv3x3(cout, cout)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.conv_shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over all h*w positions, head dim = channels."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm2d(dim, (dim, 1, 1))
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, 3 * c, h * w).transpose(-1, -2)  # [b, 1, hw, 3c]
        q, k, v = qkv.chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj(o)


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class NearestUp2x(nn.Module):
    """'nearest-exact' at factor 2 repeats each pixel; written as expand+reshape so every backend lowers it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return x[:, :, :, None, :, None].expand(b, c, h, 2, w, 2).reshape(b, c, 2 * h, 2 * w)


class Resample(nn.Module):
    """diffusers' Resample on frame 0: 'down' = pad right/bottom by one, 3x3 stride 2; 'up' = 2x, 3x3."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        if mode == "down":
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        else:
            self.resample = nn.Sequential(NearestUp2x(), conv3x3(dim, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x)


def _space_to_channels(x: torch.Tensor, fs: int, ft: int) -> torch.Tensor:
    """[b, c, h, w] -> [b, c*ft*fs*fs, h/fs, w/fs] in AvgDown3D's channel order (c, t, dy, dx); t = 0 is the
    zero frame the causal temporal pad puts before the image."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 2, 4)  # [b, c, dy, dx, h', w']
    if ft == 2:
        x = torch.stack([torch.zeros_like(x), x], dim=2)
    return x.reshape(b, c * ft * fs * fs, h // fs, w // fs)


class AvgDown(nn.Module):
    """AvgDown3D on one frame: space (and the padded time pair) to channels, then the mean of channel groups."""

    def __init__(self, cin: int, cout: int, ft: int, fs: int):
        super().__init__()
        self.cout, self.ft, self.fs = cout, ft, fs
        self.group = cin * ft * fs * fs // cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _space_to_channels(x, self.fs, self.ft)
        b, _, h, w = y.shape
        return y.view(b, self.cout, self.group, h, w).mean(dim=2)


class DupUp(nn.Module):
    """DupUp3D on the first chunk: each channel repeated, the last temporal phase's channels spread to 2x2."""

    def __init__(self, cin: int, cout: int, ft: int, fs: int = 2):
        super().__init__()
        self.cout, self.ft, self.fs = cout, ft, fs
        self.repeats = cout * ft * fs * fs // cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        fs = self.fs
        x = x[:, :, None].expand(b, c, self.repeats, h, w).reshape(b, self.cout, self.ft, fs, fs, h, w)
        x = x[:, :, self.ft - 1]  # first_chunk drops the earlier phases of the one frame
        return x.permute(0, 1, 4, 2, 5, 3).reshape(b, self.cout, h * fs, w * fs)


class DownBlock(nn.Module):
    """diffusers' QwenImage21ResidualDownBlock: resnets, then a stride-2 conv, plus the averaging shortcut."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.avg_shortcut = AvgDown(cin, cout, 2 if temporal else 1, 2 if down else 1)
        self.resnets = nn.ModuleList([ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks)])
        self.downsampler = Resample(cout, "down") if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for r in self.resnets:
            h = r(h)
        if self.downsampler is not None:
            h = self.downsampler(h)
        return h + self.avg_shortcut(x)


class UpBlock(nn.Module):
    """diffusers' QwenImage21ResidualUpBlock: resnets, then 2x and a conv, plus the duplicating shortcut."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.avg_shortcut = DupUp(cin, cout, 2 if temporal else 1) if up else None
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)])
        self.upsampler = Resample(cout, "up", cout) if up else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for r in self.resnets:
            h = r(h)
        if self.upsampler is None:
            return h
        return self.upsampler(h) + self.avg_shortcut(x)


class Encoder2d(nn.Module):
    """QwenImage21Encoder3d (is_residual) at T=1; its submodule names, so state-dict keys match."""

    def __init__(self, cfg: VAE21Config):
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        last = len(cfg.dim_mult) - 1
        self.conv_in = conv3x3(cfg.in_channels, dims[0])
        self.down_blocks = nn.ModuleList([
            DownBlock(dims[i], dims[i + 1], cfg.num_res_blocks, temporal=i != last and cfg.temperal_downsample[i],
                      down=i != last)
            for i in range(len(cfg.dim_mult))])
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm2d(dims[-1], (dims[-1], 1, 1, 1))
        self.conv_out = conv3x3(dims[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for blk in self.down_blocks:
            x = blk(x)
        return self.conv_out(F.silu(self.norm_out(self.mid_block(x))))


class Decoder2d(nn.Module):
    """QwenImage21Decoder3d (is_residual) at T=1 on the first chunk; its submodule names."""

    def __init__(self, cfg: VAE21Config):
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.decoder_dim * m for m in (mult[-1], *mult[::-1])]
        temporal_up = cfg.temperal_downsample[::-1]
        last = len(mult) - 1
        self.conv_in = conv3x3(cfg.z_dim, dims[0])
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList([
            UpBlock(dims[i], dims[i + 1], cfg.num_res_blocks, temporal=i != last and temporal_up[i], up=i != last)
            for i in range(len(mult))])
        self.norm_out = RMSNorm2d(dims[-1], (dims[-1], 1, 1, 1))
        self.conv_out = conv3x3(dims[-1], cfg.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(x))
        for blk in self.up_blocks:
            x = blk(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ------------------------------------------------------------------------------------------------ models

def _stat(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1)


class QwenImage21VAEEncoder(nn.Module):
    """Condition pixels [B, 4, H, W] in [-1, 1] (RGBA) -> normalised latent tokens [B, (H/16)(W/16), z], fp32.

    Built for one condition size (H, W), as the graphs are; `encode` returns the unpacked [B, z, H/16, W/16].
    """

    def __init__(self, config: VAE21Config, height: int, width: int):
        super().__init__()
        check_size(height, width, config.scale_factor)
        self.config, self.height, self.width = config, height, width
        self.encoder = Encoder2d(config)
        self.quant_conv = nn.Conv2d(2 * config.z_dim, 2 * config.z_dim, 1)
        # statistics come from config.json, not the weights file: kept out of state_dict
        self.register_buffer("latents_mean", _stat(config.latents_mean), persistent=False)
        self.register_buffer("latents_std", _stat(config.latents_std), persistent=False)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        moments = self.quant_conv(self.encoder(pixels.float()))
        mu = moments[:, : self.config.z_dim]  # the posterior's mode; the other half is its log-variance
        return (mu - self.latents_mean) / self.latents_std

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        z = self.encode(pixels)
        return z.flatten(2).transpose(1, 2)


class QwenImage21VAEDecoder(nn.Module):
    """Normalised latent tokens [B, (H/16)(W/16), z] -> image [B, 4, H, W] in [-1, 1] (RGBA), fp32.

    Built for one output resolution (H, W): unpacking needs the latent grid statically. `decode` takes the
    unpacked [B, z, H/16, W/16].
    """

    def __init__(self, config: VAE21Config, height: int, width: int):
        super().__init__()
        check_size(height, width, config.scale_factor)
        self.config, self.height, self.width = config, height, width
        self.post_quant_conv = nn.Conv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder2d(config)
        self.register_buffer("latents_mean", _stat(config.latents_mean), persistent=False)
        self.register_buffer("latents_std", _stat(config.latents_std), persistent=False)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        z = z.float() * self.latents_std + self.latents_mean
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        sf = self.config.scale_factor
        b, _, c = tokens.shape
        return self.decode(tokens.transpose(1, 2).reshape(b, c, self.height // sf, self.width // sf))


# -------------------------------------------------------------------------------------------- weights

def _select(mapping: Mapping[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    # only the kept names are read, so a lazy mapping (safetensors) loads nothing else
    return {name: mapping[name].float().contiguous() for name in mapping.keys()
            if name.startswith(prefixes) and ".time_conv." not in name}


def vae21_encoder_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint VAE tensors (diffusers names) -> QwenImage21VAEEncoder's state_dict, fp32: encoder.* and
    quant_conv.*, without the temporal downsamplers' time_conv (never run on one frame)."""
    return _select(mapping, ("encoder.", "quant_conv."))


def vae21_decoder_state_dict(mapping: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint VAE tensors -> QwenImage21VAEDecoder's state_dict, fp32: decoder.* and post_quant_conv.*,
    without the temporal upsamplers' time_conv (never run on the first chunk)."""
    return _select(mapping, ("decoder.", "post_quant_conv."))
