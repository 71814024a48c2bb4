"""Qwen-Image-2.1's host arithmetic (qic/models/qwen_image_21/host/sampling.py) against diffusers'
QwenImage21Pipeline: its module functions called directly, and its own __call__ run end to end on a tiny
random VAE made with diffusers' class, the real scheduler class, and stand-ins only where a model would
be (the Qwen3-VL processor and encoder, the transformer), which record what the pipeline hands them."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage21 import pipeline_qwenimage21 as ref_pipe
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # PIL backend: no torchvision

from qic.errors import ConfigError
from qic.host.condition_images import vision_grid
from qic.models.common import load_weights
from qic.models.qwen_image_21.host import sampling as s
from qic.models.qwen_image_21.vae import (
    QwenImage21VAEDecoder,
    QwenImage21VAEEncoder,
    VAE21Config,
    vae21_decoder_state_dict,
    vae21_encoder_state_dict,
)
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

FIXTURES = Path(__file__).parent / "fixtures"
REAL_SCHEDULER = json.loads((FIXTURES / "qwen-image-2.1-configs/scheduler/scheduler_config.json").read_text())
TURBO_INDEX = json.loads((FIXTURES / "qwen-image-2.1-turbo-configs/model_index.json").read_text())
TURBO_SCHEDULER = json.loads((FIXTURES / "qwen-image-2.1-turbo-configs/scheduler/scheduler_config.json").read_text())
STATIC_SHIFT = {"use_dynamic_shifting": False, "shift": 3.0, "shift_terminal": None}  # the other branch


def reference_schedule(config: dict, sigmas, seq_len: int):
    """The pipeline's step 4: mu from calculate_shift with the config's values, then retrieve_timesteps."""
    sched = FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = ref_pipe.calculate_shift(seq_len, sched.config.get("base_image_seq_len", 256),
                                  sched.config.get("max_image_seq_len", 4096), sched.config.get("base_shift", 0.5),
                                  sched.config.get("max_shift", 1.15))
    timesteps, n = ref_pipe.retrieve_timesteps(sched, len(sigmas), "cpu", sigmas=sigmas, mu=mu)
    return sched.sigmas, timesteps, n


@pytest.mark.parametrize("config", [REAL_SCHEDULER, TURBO_SCHEDULER, STATIC_SHIFT], ids=["2.1", "turbo", "static"])
@pytest.mark.parametrize("steps,hw", [(40, (1024, 1024)), (8, (2048, 1536)), (3, (64, 96)), (1, (512, 512))])
def test_schedule_is_the_schedulers(config, steps, hw):
    if steps == 1 and config.get("shift_terminal"):
        with pytest.raises(ConfigError, match="one-step"):
            s.schedule(config, s.base_sigmas(None, steps), s.image_seq_len(*hw))
        return
    default = np.linspace(1.0, 1 / steps, steps)  # what __call__ passes when no sample_sigmas is configured
    want_sigmas, want_t, n = reference_schedule(config, default, s.image_seq_len(*hw))
    got = s.schedule(config, s.base_sigmas(None, steps), s.image_seq_len(*hw))
    assert n == steps
    # the same float32 operations in the same order: equal, not close
    assert torch.equal(got.sigmas, want_sigmas) and torch.equal(got.timesteps, want_t)


def test_turbo_sample_sigmas_set_the_steps():
    sigmas = TURBO_INDEX["sample_sigmas"]
    seq = s.image_seq_len(1024, 1024)
    want_sigmas, want_t, n = reference_schedule(TURBO_SCHEDULER, sigmas, seq)
    got = s.schedule(TURBO_SCHEDULER, s.base_sigmas(sigmas, steps=40), seq)  # steps ignored, as the pipeline does
    assert n == len(sigmas) == 8
    assert torch.equal(got.sigmas, want_sigmas) and torch.equal(got.timesteps, want_t)
    # Turbo's scheduler does not reshape its grid: the sigmas are the checkpoint's (float32), then 0
    assert torch.equal(got.sigmas[:-1], torch.tensor(sigmas, dtype=torch.float32)) and got.sigmas[-1] == 0
    # the same grid through 2.1's shifting scheduler would be reshaped: the configs matter
    assert not torch.equal(s.schedule(REAL_SCHEDULER, s.base_sigmas(sigmas), seq).sigmas, got.sigmas)
    for bad in ([], [1.0, 0.0], [1.5, 0.5], [[1.0]]):
        with pytest.raises(ConfigError, match="sample_sigmas"):
            s.base_sigmas(bad)


@pytest.mark.parametrize("res", [1024, 2048, 96])
@pytest.mark.parametrize("wh", [(70, 50), (40, 90), (1920, 1080), (1000, 1000), (333, 1999), (64, 144)])
def test_sizes_are_the_pipelines(res, wh):
    w, h = wh
    want_w, want_h, _ = ref_pipe.calculate_dimensions(res * res, w / h)
    assert s.condition_size(h, w, res) == (want_h, want_w)
    oh, ow = s.output_size(res, last_condition=(h, w))
    assert (oh, ow) == (want_h // 32 * 32, want_w // 32 * 32)
    assert s.output_size(res) == (res // 32 * 32, res // 32 * 32)
    assert s.output_size(res, last_condition=(h, w), height=1000) == (1000 // 32 * 32, want_w // 32 * 32)


def test_sizes_that_round_to_nothing_are_refused():
    with pytest.raises(ConfigError, match="rounds to 0x160"):
        s.condition_size(10, 1000, output_resolution=16)
    with pytest.raises(ConfigError, match="multiple of 32"):
        s.initial_noise(0, Z, 48, 64)


@pytest.mark.parametrize("hw", [(1024, 1024), (768, 1344), (64, 96), (32, 2048), (4096, 4096), (224, 160)])
def test_vision_grid_is_smart_resize(hw):
    lo, hi = 65536, 16777216
    gh, gw = vision_grid(*hw, patch_size=16, merge_size=2, min_pixels=lo, max_pixels=hi)
    want_h, want_w = smart_resize(*hw, factor=32, min_pixels=lo, max_pixels=hi)
    assert (gh * 16, gw * 16) == (want_h, want_w)
    small = vision_grid(*hw, max_pixels=256 * 256)
    assert (small[0] * 16, small[1] * 16) == smart_resize(*hw, factor=32, min_pixels=lo, max_pixels=256 * 256)


def test_packing_is_the_pipelines():
    lat = torch.randn(2, 64, 6, 10)
    tokens = QwenImage21Pipeline._pack_latents(lat, 2, 64, 6, 10)
    assert torch.equal(s.pack(lat), tokens)
    assert torch.equal(s.unpack(tokens, 96, 160), QwenImage21Pipeline._unpack_latents(tokens, 96, 160, 16)[:, :, 0])
    assert s.target_slots(96, 160) == 15


# ------------------------------------------------------------------------------ the pipeline's own __call__

Z = 16
VAE_CONFIG = dict(base_dim=4, decoder_base_dim=6, z_dim=Z, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=1,
                  temperal_downsample=[False, True, True, True],
                  latents_mean=[0.2 * ((i % 5) - 2) for i in range(Z)],
                  latents_std=[0.6 + 0.2 * (i % 4) for i in range(Z)])


def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The stand-in transformer's prediction: v = 2 sin(20 t) x. Oscillating in t, so the Euler sum depends on
    every sigma and every fed timestep (a smooth v would integrate to nearly the same for any schedule)."""
    return 2 * torch.sin(20 * t).view(-1, 1, 1) * x
PAD_ID = 7


class Processor:
    """Stands in for Qwen3VLProcessor: records what it is given, returns a few text tokens."""
    tokenizer = SimpleNamespace(encode=lambda text: [PAD_ID])

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, return_dict=False):
        return [[1, 2, 3]]  # three system tokens to drop

    def __call__(self, text, images=None, **kwargs):
        self.calls.append({"text": text, "images": images})
        ids = torch.arange(10, 10 + 9).repeat(len(text), 1)
        return Inputs(input_ids=ids, attention_mask=torch.ones_like(ids))


class Inputs(SimpleNamespace):
    def to(self, device):
        return self


class TextEncoder(torch.nn.Module):
    """Stands in for Qwen3VLForConditionalGeneration: hidden states of the right shape."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.norm = torch.nn.Identity()
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def forward(self, input_ids, attention_mask, output_hidden_states, **kw):
        h = self.model.norm(torch.ones(*input_ids.shape, 8))
        return SimpleNamespace(hidden_states=[h])


class Transformer(torch.nn.Module):
    """Stands in for QwenImage21Transformer2DModel: records its inputs, predicts velocity(x, t)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(in_channels=Z, causal_condition=False)
        self.transformer_blocks = torch.nn.ModuleList()
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.calls = []

    @contextlib.contextmanager
    def cache_context(self, name):
        yield

    def forward(self, hidden_states, timestep, img_shapes, **kw):
        self.calls.append(SimpleNamespace(x=hidden_states.clone(), t=timestep.clone(), img_shapes=img_shapes))
        return (velocity(hidden_states, timestep),)


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLQwenImage21:
    m = AutoencoderKLQwenImage21(**VAE_CONFIG).eval()
    sensitize_(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".gamma"):
                p.copy_(1.0 + 0.1 * (2 * torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) - 1))
        m.decoder.conv_out.weight.mul_(0.3)  # keep most pixels inside the clamp
        m.decoder.conv_out.bias.mul_(0.3)
    return m


def run_pipeline(vae, scheduler_config, sample_sigmas, images, steps, res, seed):
    proc, dit = Processor(), Transformer()
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config), vae=vae,
                               text_encoder=TextEncoder(), processor=proc, transformer=dit,
                               sample_sigmas=sample_sigmas)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red circle", image=images or None, num_inference_steps=steps, output_resolution=res,
               generator=torch.Generator().manual_seed(seed)).images[0]
    return out, proc, dit


def qic_generation(vae, scheduler_config, sample_sigmas, images, steps, res, seed):
    """The same generation from qic's pieces: sizes, pixels, encoder, noise, schedule, Euler, decoder, RGBA."""
    cfg = VAE21Config.from_dict(dict(vae.config))
    last = (images[-1].height, images[-1].width) if images else None
    h, w = s.output_size(res, last_condition=last)
    cond_sizes = [s.condition_size(im.height, im.width, res) for im in images]
    cond_tokens = []
    for im, (ch, cw) in zip(images, cond_sizes):
        enc = QwenImage21VAEEncoder(cfg, ch, cw).eval()
        load_weights(enc, vae21_encoder_state_dict(vae.state_dict()), "vae")
        with torch.no_grad():
            cond_tokens.append(enc(s.condition_pixels(im, ch, cw)))
    noise = s.initial_noise(seed, Z, h, w)
    sched = s.schedule(scheduler_config, s.base_sigmas(sample_sigmas, steps), s.image_seq_len(h, w))
    x = noise
    for i, t in enumerate(s.model_timesteps(sched)):
        x = x + (sched.sigmas[i + 1] - sched.sigmas[i]) * velocity(x, t.view(1))  # the step graph's Euler step
    dec = QwenImage21VAEDecoder(cfg, h, w).eval()
    load_weights(dec, vae21_decoder_state_dict(vae.state_dict()), "vae")
    with torch.no_grad():
        image = s.to_images(dec(x))[0]
    return SimpleNamespace(size=(h, w), cond_sizes=cond_sizes, cond_tokens=cond_tokens, noise=noise, sched=sched,
                           image=image)


def _rgb(w, h, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _rgba(w, h, seed):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    a[: h // 2, :, 3] = 0  # half transparent: the white composite and the VAE's alpha both show
    return Image.fromarray(a, "RGBA")


CASES = {
    # text to image, 2.1's schedule at 40 steps, output_resolution square
    "t2i": dict(config=REAL_SCHEDULER, sigmas=None, images=[], steps=40, res=96),
    # Turbo: the checkpoint's sample_sigmas (8 steps whatever num_inference_steps says), its static scheduler
    "turbo": dict(config=TURBO_SCHEDULER, sigmas=TURBO_INDEX["sample_sigmas"], images=[], steps=40, res=64),
    # two condition images of different aspect, RGB then RGBA; the output takes the last one's aspect.
    # 40x90 at 96**2 px: 144/32 = 4.5 rounds to 4 (Python's round), a size the pipeline derives the same way
    "two_conditions": dict(config=REAL_SCHEDULER, sigmas=None, images=[(_rgb, 70, 50), (_rgba, 40, 90)], steps=3,
                           res=96),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_follows_the_pipeline(vae, case):
    c = CASES[case]
    images = [make(w, h, seed) for seed, (make, w, h) in enumerate(c["images"])]
    out, proc, dit = run_pipeline(vae, c["config"], c["sigmas"], images, c["steps"], c["res"], seed=5)
    ours = qic_generation(vae, c["config"], c["sigmas"], images, c["steps"], c["res"], seed=5)

    # sizes: the output and each condition image, as img_shapes gives them (latent grids)
    h, w = ours.size
    assert out.size == (w, h) and out.mode == "RGBA"
    grids = [(1, ch // 16, cw // 16) for ch, cw in ours.cond_sizes]
    assert dit.calls[0].img_shapes == [[*grids, (1, h // 16, w // 16)]]
    # the schedule: one call per sigma, fed t / 1000
    assert torch.equal(torch.cat([call.t for call in dit.calls]), s.model_timesteps(ours.sched))
    n = s.image_seq_len(h, w)
    first = dit.calls[0].x
    # the initial noise, drawn and packed as the pipeline does: equal
    assert torch.equal(first[:, -n:], ours.noise)
    if images:
        # what the vision encoder gets: the resized copy composited over white (the processor's input) ...
        got_vision = proc.calls[0]["images"]
        for im, (ch, cw), v in zip(images, ours.cond_sizes, got_vision):
            assert np.array_equal(np.asarray(v), np.asarray(s.vision_image(im, ch, cw)))
        # ... and the condition tokens: qic's encoder on qic's RGBA pixels vs the pipeline's, in order
        want = first[:, :-n]
        got = torch.cat(ours.cond_tokens, dim=1)
        err = rel_l2(got, want)
        print(f"{case}: condition tokens rel-L2 {err:.2e} max-abs {(got - want).abs().max():.2e}")
        assert err < fp32_reorder_bound(576, 60)  # the VAE test's bound: same kernels, reordered sums
    # the image: every step's sigma and the decode, to 8-bit RGBA; fp32 differences of ~1e-6 can flip a
    # rounding, never more than one level
    a = np.asarray(out).astype(int)
    b = np.asarray(ours.image).astype(int)
    diff = np.abs(a - b)
    print(f"{case}: {h}x{w}, {len(ours.sched.timesteps)} steps, max level diff {diff.max()}, "
          f"mean {diff.mean():.4f}")
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_the_check_can_fail(vae):
    """What the generation test compares moves far outside its tolerance under plausible mistakes: Turbo's
    checkpoint sigmas ignored (2.1's default 40 steps), Turbo's grid put through 2.1's shifting scheduler, and
    the RGBA condition image flattened over white for the VAE too (only the vision copy is)."""
    c = CASES["turbo"]
    out, _, _ = run_pipeline(vae, c["config"], c["sigmas"], [], c["steps"], c["res"], seed=5)
    for config, sigmas in ((REAL_SCHEDULER, None), (REAL_SCHEDULER, c["sigmas"])):
        wrong = qic_generation(vae, config, sigmas, [], c["steps"], c["res"], seed=5)
        diff = np.abs(np.asarray(out).astype(int) - np.asarray(wrong.image).astype(int))
        print(f"wrong schedule: mean level diff {diff.mean():.2f}")
        assert diff.mean() > 5
    c = CASES["two_conditions"]
    images = [make(w, h, seed) for seed, (make, w, h) in enumerate(c["images"])]
    _, _, dit = run_pipeline(vae, c["config"], c["sigmas"], images, c["steps"], c["res"], seed=5)
    flat = s.vision_image(images[1], images[1].height, images[1].width)  # alpha composited over white
    ours = qic_generation(vae, c["config"], c["sigmas"], [images[0], flat], c["steps"], c["res"],
                          seed=5)
    n = s.image_seq_len(*ours.size)
    err = rel_l2(torch.cat(ours.cond_tokens, dim=1), dit.calls[0].x[:, :-n])
    print(f"condition flattened for the VAE: rel-L2 {err:.2e}")
    assert err > 100 * fp32_reorder_bound(576, 60)


@pytest.mark.parametrize("wh", [(70, 50), (1920, 1080), (333, 1999), (1000, 1000)])
def test_edit_plus_sizes_are_its_pipelines(wh):
    """The same sizing serves the Edit Plus pipeline (qic.host.condition_images): its VAE side at 1024*1024 and its
    vision side at 384*384 pixels, then Qwen2.5-VL's processor (patch 14, merge 2) on the vision copy."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    from qic.host.condition_images import calculate_dimensions
    w, h = wh
    for area in (edit_plus.VAE_IMAGE_SIZE, edit_plus.CONDITION_IMAGE_SIZE):
        want_w, want_h = edit_plus.calculate_dimensions(area, w / h)
        assert calculate_dimensions(area, w / h) == (want_h, want_w)
    ch, cw = calculate_dimensions(edit_plus.CONDITION_IMAGE_SIZE, w / h)
    gh, gw = vision_grid(ch, cw, patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056)
    assert (gh * 14, gw * 14) == smart_resize(ch, cw, factor=28, min_pixels=3136, max_pixels=12845056)
