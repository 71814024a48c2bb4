"""qic's single-frame 2D VAE decoder against diffusers' causal 3D AutoencoderKLQwenImage (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from qic.checkpoint.presets import preset
from qic.errors import CheckpointError, ConfigError
from qic.host.latents import pack as pack_latents
from qic.host.latents import unpack
from qic.models.common import load_weights
from qic.models.qwen_image.vae_decoder import QwenVAEDecoder, VAEConfig, vae_decoder_state_dict
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

SIZES = {"tiny": (48, 80), "tiny-alt": (40, 24)}  # (height, width), non-square on purpose
# sensitize_ alone drives the tiny VAE's pre-clamp output to std ~1.2, so ~39% of pixels sit on the
# +-1 clamp, where no difference can show. Shrinking the last conv keeps nearly all pixels inside.
CONV_OUT_SCALE = 0.3


class Case:
    def __init__(self, name: str):
        self.name = name
        self.cfg_dict = preset(name)["vae"]
        self.height, self.width = SIZES[name]
        ref = AutoencoderKLQwenImage.from_config(self.cfg_dict).eval()
        sensitize_(ref)
        with torch.no_grad():
            ref.decoder.conv_out.weight.mul_(CONV_OUT_SCALE)
            ref.decoder.conv_out.bias.mul_(CONV_OUT_SCALE)
        self.ref = ref
        # fp32 reordering bound (tests/helpers.py): one reduction per conv (plus the attention), each at
        # most the largest conv's fan-in (3x3x3 x channels) long. About 6e-5 for tiny (measured ~1.5e-6);
        # a 1% error in one channel's latent std already moves the image by 1e-2.
        convs = [m for m in ref.decoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
        self.bound = fp32_reorder_bound(max(m.weight[0].numel() for m in convs), len(convs) + 2)
        self.cfg = VAEConfig.from_dict(self.cfg_dict)
        self.model = self.build(self.cfg)
        sf = self.cfg.scale_factor
        self.h, self.w = self.height // sf, self.width // sf

    def build(self, cfg: VAEConfig) -> QwenVAEDecoder:
        m = QwenVAEDecoder(cfg, self.height, self.width).eval()
        load_weights(m, vae_decoder_state_dict(self.ref.state_dict()), "vae")
        return m

    def packed(self, seed: int, batch: int = 2) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(batch, self.cfg.z_dim, self.h, self.w, generator=g)
        return QwenImagePipeline._pack_latents(z, batch, self.cfg.z_dim, self.h, self.w)

    @torch.no_grad()
    def reference(self, packed: torch.Tensor) -> torch.Tensor:
        """diffusers' pipeline decode path: unpack to 5D (T=1), z / (1/std) + mean, decode, frame 0."""
        lat = QwenImagePipeline._unpack_latents(packed, self.height, self.width, self.cfg.scale_factor)
        z = self.cfg.z_dim
        mean = torch.tensor(self.cfg_dict["latents_mean"]).view(1, z, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(self.cfg_dict["latents_std"]).view(1, z, 1, 1, 1)
        return self.ref.decode(lat / inv_std + mean, return_dict=False)[0][:, :, 0]


@pytest.fixture(scope="module", params=["tiny", "tiny-alt"])
def case(request) -> Case:
    torch.manual_seed(0)
    return Case(request.param)


def test_parity_with_diffusers(case):
    packed = case.packed(seed=1)
    ref = case.reference(packed)
    with torch.no_grad():
        out = case.model(packed)
    assert out.shape == (2, 3, case.height, case.width) and out.dtype == torch.float32
    # the check must be able to see something: an image, not a constant or a clamped field
    assert ref.std() > 0.1
    assert (ref.abs() == 1).float().mean() < 0.05
    err = rel_l2(out, ref)
    print(f"{case.name}: rel-L2 {err:.2e}")
    assert err <= case.bound


def test_parity_check_can_fail(case):
    packed = case.packed(seed=1)
    ref = case.reference(packed)
    with torch.no_grad():
        other_latents = case.model(case.packed(seed=2))
        # one latent channel's std off by 1%
        std = list(case.cfg.latents_std)
        std[0] *= 1.01
        skewed = case.build(dataclasses.replace(case.cfg, latents_std=tuple(std)))(packed)
        # the classic mistake: dividing by the raw std instead of multiplying
        wrong = case.build(case.cfg)
        wrong.latents_std = 1.0 / wrong.latents_std
        divided = wrong(packed)
    for label, out in [("other latents", other_latents), ("std +1%", skewed), ("divide by std", divided)]:
        err = rel_l2(out, ref)
        print(f"{case.name}: {label} rel-L2 {err:.2e}")
        assert err > 100 * case.bound, label


def test_time_conv_is_unused_at_one_frame(case):
    """Why vae_decoder_state_dict may drop the upsample3d time_conv tensors: diffusers skips them on frame 0."""
    packed = case.packed(seed=3, batch=1)
    before = case.reference(packed)
    names = [n for n in case.ref.state_dict() if ".time_conv." in n and n.startswith("decoder.")]
    assert names  # both presets have temporal upsamplers
    saved = {n: t.clone() for n, t in case.ref.state_dict().items() if n in names}
    try:
        with torch.no_grad():
            for n in names:
                case.ref.get_parameter(n).add_(1.0)
        assert torch.equal(case.reference(packed), before)
    finally:
        case.ref.load_state_dict(saved, strict=False)


def test_state_dict_selection(case):
    sd = vae_decoder_state_dict(case.ref.state_dict())
    assert set(sd) == set(case.model.state_dict())
    assert not any(n.startswith(("encoder.", "quant_conv.")) or ".time_conv." in n for n in sd)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in sd.values())
    w3 = case.ref.state_dict()["decoder.conv_in.weight"]
    assert torch.equal(sd["decoder.conv_in.weight"], w3[:, :, -1])


def test_pack_roundtrip(case):
    packed = case.packed(seed=4)
    sf = case.cfg.scale_factor
    z = unpack(packed, case.height // sf // 2, case.width // sf // 2)
    ref = QwenImagePipeline._unpack_latents(packed, case.height, case.width, case.cfg.scale_factor)[:, :, 0]
    assert torch.equal(z, ref)
    assert torch.equal(pack_latents(z), packed)


def test_config():
    cfg = VAEConfig.from_dict(preset("tiny")["vae"])
    assert cfg.scale_factor == 8 and cfg.z_dim == 4 and cfg.input_channels == 3
    alt = VAEConfig.from_dict(preset("tiny-alt")["vae"])
    assert alt.scale_factor == 4 and alt.z_dim == 8
    # config.json as diffusers writes it (input_channels, _use_default_values, ...) is accepted
    ref_cfg = dict(AutoencoderKLQwenImage.from_config(preset("tiny-alt")["vae"]).config)
    assert VAEConfig.from_dict(ref_cfg) == alt


def test_config_refuses_unknown_key():
    d = preset("tiny")["vae"]
    d["temporal_upsample_mode"] = "new"
    with pytest.raises(ConfigError, match="temporal_upsample_mode"):
        VAEConfig.from_dict(d)


def test_config_refuses_inconsistent_values():
    d = preset("tiny")["vae"]
    d["latents_std"] = d["latents_std"][:-1]
    with pytest.raises(ConfigError, match="z_dim"):
        VAEConfig.from_dict(d)
    d = preset("tiny")["vae"]
    del d["z_dim"]
    with pytest.raises(ConfigError, match="z_dim"):
        VAEConfig.from_dict(d)


def test_refuses_size_not_multiple_of_packing():
    cfg = VAEConfig.from_dict(preset("tiny")["vae"])  # sf 8: sizes must be multiples of 16
    with pytest.raises(ConfigError, match="multiple of 16"):
        QwenVAEDecoder(cfg, 48, 72)


def test_missing_tensor_is_named(case):
    sd = vae_decoder_state_dict(case.ref.state_dict())
    del sd["decoder.mid_block.attentions.0.to_qkv.weight"]
    m = QwenVAEDecoder(case.cfg, case.height, case.width)
    with pytest.raises(CheckpointError, match=r"decoder\.mid_block\.attentions\.0\.to_qkv\.weight"):
        load_weights(m, sd, "vae")


def test_export(case):
    packed = case.packed(seed=5)
    with torch.no_grad():
        eager = case.model(packed)
        ep = torch.export.export(case.model, (packed,))
        exported = ep.module()(packed)
    assert rel_l2(exported, eager) <= case.bound  # export may decompose and reorder
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert not val.dtype.is_complex, node
    for t in list(ep.state_dict.values()) + list(ep.constants.values()):
        assert not t.dtype.is_complex
