"""qic's single-frame 2D VAE encoder against diffusers' causal 3D AutoencoderKLQwenImage as the edit pipelines
call it (posterior mode, `(mu - mean) / std`, packed 2x2), fp32 on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline

from qic.checkpoint.presets import preset
from qic.errors import ConfigError
from qic.models.common import load_weights
from qic.models.qwen_image.vae_decoder import VAEConfig
from qic.models.qwen_image.vae_encoder import QwenVAEEncoder, vae_encoder_state_dict
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

CASES = {"tiny": ("tiny", (48, 80), {}), "tiny-alt": ("tiny-alt", (40, 24), {})}   # (height, width), non-square


class Case:
    def __init__(self, name: str):
        preset_name, (self.height, self.width), overrides = CASES[name]
        self.name = name
        self.cfg_dict = {**preset(preset_name)["vae"], **overrides}
        self.ref = sensitize_(AutoencoderKLQwenImage.from_config(self.cfg_dict).eval())
        # fp32 reordering bound (tests/helpers.py): one reduction per conv plus the attention's two, each at most
        # the largest conv's fan-in long; a wrong kernel slice, statistic or half moves the latents by 1e-1 or more.
        convs = [m for m in self.ref.encoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
        self.bound = fp32_reorder_bound(max(m.weight[0].numel() for m in convs), len(convs) + 2)
        self.cfg = VAEConfig.from_dict(self.cfg_dict)
        self.model = self.build(self.cfg)

    def build(self, cfg: VAEConfig, state: dict | None = None) -> QwenVAEEncoder:
        m = QwenVAEEncoder(cfg, self.height, self.width).eval()
        load_weights(m, state or vae_encoder_state_dict(self.ref.state_dict()), "vae")
        return m

    def image(self, seed: int, batch: int = 2) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.rand(batch, 3, self.height, self.width, generator=g) * 2 - 1

    @torch.no_grad()
    def reference(self, image: torch.Tensor) -> torch.Tensor:
        """QwenImageEditPlusPipeline's condition latents: _encode_vae_image on the 5D frame, then _pack_latents."""
        pipe = QwenImageEditPlusPipeline.__new__(QwenImageEditPlusPipeline)   # only its methods and two fields
        pipe.vae, pipe.latent_channels = self.ref, self.cfg.z_dim
        latents = pipe._encode_vae_image(image[:, :, None], generator=None)
        h, w = latents.shape[3:]
        return pipe._pack_latents(latents, image.shape[0], self.cfg.z_dim, h, w)


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    torch.manual_seed(0)
    return Case(request.param)


def test_parity_with_the_edit_pipelines_encode(case):
    image = case.image(seed=1)
    ref = case.reference(image)
    with torch.no_grad():
        out = case.model(image)
    sf = case.cfg.scale_factor
    assert out.shape == (2, (case.height // sf // 2) * (case.width // sf // 2), 4 * case.cfg.z_dim)
    assert ref.std() > 0.1   # latents that vary, so a difference can show
    err = rel_l2(out, ref)
    print(f"{case.name}: rel-L2 {err:.2e} (bound {case.bound:.1e})")
    assert err <= case.bound


def test_parity_check_can_fail(case):
    image = case.image(seed=1)
    ref = case.reference(image)
    state = vae_encoder_state_dict(case.ref.state_dict())
    first_slice = dict(state, **{"encoder.conv_in.weight": case.ref.state_dict()["encoder.conv_in.weight"][:, :, 0]})
    std = list(case.cfg.latents_std)
    std[0] *= 1.03   # one channel of z_dim: about 3% / sqrt(z_dim) of the latents, hundreds of bounds
    with torch.no_grad():
        variants = {
            "another image": case.model(case.image(seed=2)),
            "conv_in's first temporal slice": case.build(case.cfg, first_slice)(image),
            "one channel's std +3%": case.build(dataclasses.replace(case.cfg, latents_std=tuple(std)))(image),
            "multiplied by std": _multiplying(case.build(case.cfg))(image),
            "log-variance half": _logvar_half(case.model, image),
        }
    for label, out in variants.items():
        err = rel_l2(out, ref)
        print(f"{case.name}: {label}: rel-L2 {err:.2e}")
        assert err > 100 * case.bound, label


def _multiplying(model: QwenVAEEncoder) -> QwenVAEEncoder:
    # the classic mistake: multiplying by the std as the decoder does, not dividing
    model.latents_std = 1.0 / model.latents_std
    return model


def _logvar_half(model: QwenVAEEncoder, image: torch.Tensor) -> torch.Tensor:
    from qic.host.latents import pack
    z = model.config.z_dim
    return pack((model.quant_conv(model.encoder(image))[:, z:] - model.latents_mean) / model.latents_std)


def test_time_conv_is_unused_on_one_frame(case):
    """Why vae_encoder_state_dict drops the downsample3d time_conv tensors: diffusers skips them on frame 0."""
    image = case.image(seed=3, batch=1)
    before = case.reference(image)
    names = [n for n in case.ref.state_dict() if ".time_conv." in n and n.startswith("encoder.")]
    assert names   # both presets downsample in time
    saved = {n: t.clone() for n, t in case.ref.state_dict().items() if n in names}
    try:
        with torch.no_grad():
            for n in names:
                case.ref.get_parameter(n).add_(1.0)
        assert torch.equal(case.reference(image), before)
    finally:
        case.ref.load_state_dict(saved, strict=False)


def test_state_dict_selection(case):
    sd = vae_encoder_state_dict(case.ref.state_dict())
    assert set(sd) == set(case.model.state_dict())
    assert not any(n.startswith(("decoder.", "post_quant_conv.")) or ".time_conv." in n for n in sd)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in sd.values())


def test_refuses_a_size_not_multiple_of_the_packing_and_attention_in_the_down_blocks():
    cfg = VAEConfig.from_dict(preset("tiny")["vae"])
    with pytest.raises(ConfigError, match="not a positive multiple of 16"):
        QwenVAEEncoder(cfg, 40, 48)
    with pytest.raises(ConfigError, match="attn_scales"):
        QwenVAEEncoder(dataclasses.replace(cfg, attn_scales=(0.5,)), 32, 32)


def test_exports_whole(case):
    image = case.image(seed=4, batch=1)
    program = torch.export.export(case.model, (image,))
    with torch.no_grad():
        assert torch.equal(program.module()(image), case.model(image))
