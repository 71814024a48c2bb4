"""qic's single-frame 2D Qwen-Image-2.1 VAE (qic/models/qwen_image_21/vae.py) against diffusers' own
AutoencoderKLQwenImage21, fp32 on CPU, through the pipeline's own normalisation and packing helpers."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLQwenImage21
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline

from qic.errors import CheckpointError, ConfigError
from qic.models.common import load_weights
from qic.models.qwen_image_21 import vae as vae21
from qic.models.qwen_image_21.vae import (
    QwenImage21VAEDecoder,
    QwenImage21VAEEncoder,
    VAE21Config,
    vae21_decoder_state_dict,
    vae21_encoder_state_dict,
)
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

Z = 16
# The real architecture at a small width: five stages (16x: the pipeline hard-codes 16), residual blocks,
# temporal flags as published, so every AvgDown/DupUp variant (with and without the time pair) is exercised.
CONFIG = dict(base_dim=4, decoder_base_dim=6, z_dim=Z, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=1,
              temperal_downsample=[False, True, True, True],
              latents_mean=[0.3 * ((i % 5) - 2) for i in range(Z)],
              latents_std=[0.5 + 0.25 * (i % 4) for i in range(Z)])
# Multiples of 16 with odd latent grids (3x5, 5x3, 1x7): the VAE allows them; the pipeline's own sizes are
# multiples of 32, (64, 96) is one.
SIZES = [(48, 80), (80, 48), (16, 112), (64, 96)]
# sensitize_ leaves the decoder's pre-clamp output wide, so many pixels would sit on the +-1 clamp where no
# difference shows; shrinking the last conv keeps nearly all inside.
CONV_OUT_SCALE = 0.3


@pytest.fixture(scope="module")
def ref() -> AutoencoderKLQwenImage21:
    m = AutoencoderKLQwenImage21(**CONFIG).eval()
    sensitize_(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".gamma"):  # norm scales around 1, not drawn as matrices
                g = torch.Generator().manual_seed(len(name))
                p.copy_(1.0 + 0.1 * (2 * torch.rand(p.shape, generator=g) - 1))
        m.decoder.conv_out.weight.mul_(CONV_OUT_SCALE)
        m.decoder.conv_out.bias.mul_(CONV_OUT_SCALE)
    return m


@pytest.fixture(scope="module")
def cfg(ref) -> VAE21Config:
    return VAE21Config.from_dict(dict(ref.config))


def bound(module: torch.nn.Module) -> float:
    # fp32 reordering bound (tests/helpers.py): one reduction per conv plus the attention's two, each at most
    # the largest conv's fan-in long: 2e-5 (encoder) and 3e-5 (decoder) here, measured 2e-7..1e-6. A wrong
    # shortcut phase, a replicated instead of zero pad or 1/std for std moves the output by 1e-2 or more.
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    return fp32_reorder_bound(max(c.weight[0].numel() for c in convs), len(convs) + 2)


def encoder(ref, cfg, h, w) -> QwenImage21VAEEncoder:
    m = QwenImage21VAEEncoder(cfg, h, w).eval()
    load_weights(m, vae21_encoder_state_dict(ref.state_dict()), "vae")  # strict, by the checkpoint's names
    return m


def decoder(ref, cfg, h, w) -> QwenImage21VAEDecoder:
    m = QwenImage21VAEDecoder(cfg, h, w).eval()
    load_weights(m, vae21_decoder_state_dict(ref.state_dict()), "vae")
    return m


def pipeline_stub(ref):
    """What QwenImage21Pipeline's own _encode_vae_image / prepare_latents read from self."""
    class Stub:
        vae = ref
        latent_channels = Z
        vae_scale_factor = 16
        _pack_latents = staticmethod(QwenImage21Pipeline._pack_latents)

        def _encode_vae_image(self, image, generator):
            return QwenImage21Pipeline._encode_vae_image(self, image, generator)
    return Stub()


def pixels(h, w, seed=0, batch=1) -> torch.Tensor:
    return torch.rand(batch, 4, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def reference_tokens(ref, px: torch.Tensor) -> torch.Tensor:
    """The pipeline's condition-image path: encode at the mode, (mu - mean) / std, pack."""
    _, tokens = QwenImage21Pipeline.prepare_latents(pipeline_stub(ref), [px.unsqueeze(2)], px.shape[0], Z,
                                                     px.shape[2], px.shape[3], torch.float32, "cpu", None,
                                                     latents=torch.zeros(1))
    return tokens


@torch.no_grad()
def reference_image(ref, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The pipeline's decode tail: unpack, z * std + mean, decode, frame 0 (clamped by the VAE)."""
    lat = QwenImage21Pipeline._unpack_latents(tokens, h, w, 16)
    mean = torch.tensor(ref.config.latents_mean).view(1, Z, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, Z, 1, 1, 1)
    return ref.decode(lat * std + mean, return_dict=False)[0][:, :, 0]


@pytest.mark.parametrize("h,w", SIZES)
def test_encoder_matches_diffusers(ref, cfg, h, w):
    m = encoder(ref, cfg, h, w)
    px = pixels(h, w, batch=2)
    want = reference_tokens(ref, px)
    with torch.no_grad():
        got = m(px)
    assert got.shape == want.shape == (2, (h // 16) * (w // 16), Z)
    err = rel_l2(got, want)
    print(f"encoder {h}x{w}: rel-L2 {err:.2e} max-abs {(got - want).abs().max():.2e} (bound {bound(m):.1e})")
    assert err < bound(m)


@pytest.mark.parametrize("h,w", SIZES)
def test_decoder_matches_diffusers(ref, cfg, h, w):
    m = decoder(ref, cfg, h, w)
    tokens = torch.randn(2, (h // 16) * (w // 16), Z, generator=torch.Generator().manual_seed(1))
    if h % 32 == 0 and w % 32 == 0:
        want = reference_image(ref, tokens, h, w)  # the pipeline's own unpack
    else:  # _unpack_latents rounds to multiples of 32; the VAE itself takes the odd grid
        with torch.no_grad():
            z = tokens.transpose(1, 2).reshape(2, Z, 1, h // 16, w // 16)
            mean = torch.tensor(ref.config.latents_mean).view(1, Z, 1, 1, 1)
            std = torch.tensor(ref.config.latents_std).view(1, Z, 1, 1, 1)
            want = ref.decode(z * std + mean, return_dict=False)[0][:, :, 0]
    with torch.no_grad():
        got = m(tokens)
    assert got.shape == want.shape == (2, 4, h, w)  # RGBA out
    clamped = float((want.abs() == 1).float().mean())
    assert clamped < 0.05, "most pixels must sit inside the clamp for the comparison to mean anything"
    err = rel_l2(got, want)
    print(f"decoder {h}x{w}: rel-L2 {err:.2e} max-abs {(got - want).abs().max():.2e} (bound {bound(m):.1e})")
    assert err < bound(m)


@pytest.mark.parametrize("break_it", ["replicate_pad", "first_phase", "inverse_std"])
def test_broken_variants_fail_the_bound(ref, cfg, monkeypatch, break_it):
    """Each mistake one could make reading the 3D reference breaks the bound above by orders of magnitude."""
    h, w = SIZES[0]
    if break_it == "replicate_pad":  # AvgDown3D's time pair padded with the frame itself instead of zeros
        def replicated(x, fs, ft):
            b, c, hh, ww = x.shape
            x = x.view(b, c, hh // fs, fs, ww // fs, fs).permute(0, 1, 3, 5, 2, 4)
            if ft == 2:
                x = torch.stack([x, x], dim=2)
            return x.reshape(b, c * ft * fs * fs, hh // fs, ww // fs)
        monkeypatch.setattr(vae21, "_space_to_channels", replicated)
        m = encoder(ref, cfg, h, w)
        px = pixels(h, w)
        want = reference_tokens(ref, px)
        with torch.no_grad():
            got = m(px)
    else:
        m = decoder(ref, cfg, h, w)
        if break_it == "first_phase":  # DupUp3D's first chunk read at phase 0 instead of the last
            def first(self, x):
                b, c, hh, ww = x.shape
                x = x[:, :, None].expand(b, c, self.repeats, hh, ww).reshape(b, self.cout, self.ft, 2, 2, hh, ww)
                return x[:, :, 0].permute(0, 1, 4, 2, 5, 3).reshape(b, self.cout, hh * 2, ww * 2)
            monkeypatch.setattr(vae21.DupUp, "forward", first)
        else:  # Qwen-Image's convention (the config holds 1/std) applied to 2.1's config, which holds std
            m.latents_std = 1 / m.latents_std
        tokens = torch.randn(1, (h // 16) * (w // 16), Z, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            z = tokens.transpose(1, 2).reshape(1, Z, 1, h // 16, w // 16)
            mean = torch.tensor(ref.config.latents_mean).view(1, Z, 1, 1, 1)
            std = torch.tensor(ref.config.latents_std).view(1, Z, 1, 1, 1)
            want = ref.decode(z * std + mean, return_dict=False)[0][:, :, 0]
            got = m(tokens)
    err = rel_l2(got, want)
    print(f"{break_it}: rel-L2 {err:.2e}")
    assert err > 100 * bound(m)


def test_export_has_no_graph_break(ref, cfg):
    """Compile-friendly: both halves go through torch.export at a static size and give the eager result."""
    h, w = 48, 80
    enc, dec = encoder(ref, cfg, h, w), decoder(ref, cfg, h, w)
    px, tokens = pixels(h, w), torch.randn(1, 15, Z)
    for m, x in ((enc, px), (dec, tokens)):
        ep = torch.export.export(m, (x,))
        with torch.no_grad():
            assert rel_l2(ep.module()(x), m(x)) < bound(m)


def test_state_dict_names_and_refusals(ref, cfg):
    sd = ref.state_dict()
    dec_sd = vae21_decoder_state_dict(sd)
    assert not any(".time_conv." in k or k.startswith(("encoder.", "quant_conv.")) for k in dec_sd)
    assert {k for k in sd if k.startswith(("decoder.", "post_quant_conv.")) and ".time_conv." not in k} == set(dec_sd)
    m = QwenImage21VAEDecoder(cfg, 32, 32)
    with pytest.raises(CheckpointError, match="missing tensors: decoder.conv_in.bias"):
        load_weights(m, {k: v for k, v in dec_sd.items() if k != "decoder.conv_in.bias"}, "vae")
    with pytest.raises(ConfigError, match="multiple of the VAE's 16x"):
        QwenImage21VAEDecoder(cfg, 40, 32)
    base = dict(ref.config)
    with pytest.raises(ConfigError, match="is_residual=false"):
        VAE21Config.from_dict({**base, "is_residual": False})
    with pytest.raises(ConfigError, match="patch_size=2"):
        VAE21Config.from_dict({**base, "patch_size": 2})
    with pytest.raises(ConfigError, match="does not support: use_fancy"):
        VAE21Config.from_dict({**base, "use_fancy": True})
    with pytest.raises(ConfigError, match="gives a 8x VAE"):
        VAE21Config.from_dict({**base, "dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True]})
