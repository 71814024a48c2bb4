"""Host glue vs diffusers: sigma schedule, initial noise, packing."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from qic.checkpoint.presets import QWEN_IMAGE_SCHEDULER
from qic.errors import ConfigError, QicError
from qic.host import latents, prompt
from qic.host.schedule import flow_match_schedule


def diffusers_schedule(config, steps, seq_len):
    sched = FlowMatchEulerDiscreteScheduler.from_config(config)
    import numpy as np
    mu = calculate_shift(seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return sched.sigmas, timesteps


@pytest.mark.parametrize("steps", [2, 3, 6, 20, 50])
@pytest.mark.parametrize("seq_len", [15, 256, 1024, 4096])
def test_schedule_equals_diffusers(steps, seq_len):
    ref_sigmas, ref_t = diffusers_schedule(QWEN_IMAGE_SCHEDULER, steps, seq_len)
    ours = flow_match_schedule(QWEN_IMAGE_SCHEDULER, steps, seq_len)
    assert torch.equal(ours.sigmas, ref_sigmas)
    assert torch.equal(ours.timesteps, ref_t)


def test_schedule_depends_on_resolution_and_config_variants():
    a = flow_match_schedule(QWEN_IMAGE_SCHEDULER, 8, 64).sigmas
    b = flow_match_schedule(QWEN_IMAGE_SCHEDULER, 8, 4096).sigmas
    assert (a - b).abs().max() > 1e-3
    for variant in ({"time_shift_type": "linear"}, {"shift_terminal": None},
                    {"use_dynamic_shifting": False, "shift": 3.0}):
        cfg = {**QWEN_IMAGE_SCHEDULER, **variant}
        ref_sigmas, _ = diffusers_schedule(cfg, 7, 300) if cfg["use_dynamic_shifting"] else (None, None)
        ours = flow_match_schedule(cfg, 7, 300)
        if ref_sigmas is None:
            sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
            import numpy as np
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 7, 7))
            ref_sigmas = sched.sigmas
        assert torch.equal(ours.sigmas, ref_sigmas), variant


def test_one_step_with_shift_terminal_is_refused_where_diffusers_gives_nan():
    ref_sigmas, _ = diffusers_schedule(QWEN_IMAGE_SCHEDULER, 1, 256)
    assert torch.isnan(ref_sigmas[0])
    with pytest.raises(ConfigError, match="steps must be >= 2"):
        flow_match_schedule(QWEN_IMAGE_SCHEDULER, 1, 256)
    assert flow_match_schedule({**QWEN_IMAGE_SCHEDULER, "shift_terminal": None}, 1, 256).sigmas.isfinite().all()


def test_schedule_refuses_unsupported():
    with pytest.raises(ConfigError, match="use_karras_sigmas"):
        flow_match_schedule({**QWEN_IMAGE_SCHEDULER, "use_karras_sigmas": True}, 4, 64)
    with pytest.raises(ConfigError, match="steps"):
        flow_match_schedule(QWEN_IMAGE_SCHEDULER, 0, 64)


def test_noise_and_packing_match_diffusers():
    from diffusers.utils.torch_utils import randn_tensor
    z, h, w, sf = 4, 48, 80, 8
    ours = latents.initial_noise(1234, z, h, w, sf)
    gen = torch.Generator("cpu").manual_seed(1234)
    ref = randn_tensor((1, 1, z, h // sf, w // sf), generator=gen, dtype=torch.float32)
    ref = QwenImagePipeline._pack_latents(ref, 1, z, h // sf, w // sf)
    assert torch.equal(ours, ref)
    rows, cols = latents.packed_grid(h, w, sf)
    unpacked = latents.unpack(ours, rows, cols)
    ref_unpacked = QwenImagePipeline._unpack_latents(ours, h, w, sf)[:, :, 0]
    assert torch.equal(unpacked, ref_unpacked)
    assert torch.equal(latents.pack(unpacked), ours)


def test_resolution_must_be_multiple_of_twice_scale():
    with pytest.raises(ConfigError, match="multiple of 16"):
        latents.check_resolution(40, 64, 8)
    latents.check_resolution(40, 64, 4)  # a VAE with scale 4 takes multiples of 8


def test_template_matches_diffusers_and_buckets():
    pipe_template = QwenImagePipeline.__init__.__code__.co_consts
    assert prompt.TEMPLATE in pipe_template
    assert prompt.pick_bucket(50, [64, 128]) == 64
    assert prompt.pick_bucket(64, [128, 64]) == 64
    assert prompt.pick_bucket(77, [0]) == 0
    with pytest.raises(QicError, match="longer than the largest text bucket"):
        prompt.pick_bucket(200, [64, 128])


@pytest.mark.parametrize("images", [1, 2, 3])
def test_edit_prompt_text_is_the_edit_pipelines(images):
    """QwenImageEditPlusPipeline's text (its template around "Picture i: <vision tokens>" per image and the prompt)
    and QwenImageEditPipeline's (one image inline), with the 64 dropped tokens they both skip."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    from qic.host.prompt import EDIT_DROP_TOKENS, edit_prompt_text
    parts = dict(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None)
    plus, v1 = QwenImageEditPlusPipeline(**parts), QwenImageEditPipeline(**parts)
    prompt = "make the circle red"
    pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(images))
    assert edit_prompt_text(prompt, images) == plus.prompt_template_encode.format(pictures + prompt)
    assert EDIT_DROP_TOKENS == plus.prompt_template_encode_start_idx == v1.prompt_template_encode_start_idx
    if images == 1:
        assert edit_prompt_text(prompt, 1, plus=False) == v1.prompt_template_encode.format(prompt)
    else:
        with pytest.raises(QicError, match="one condition image"):
            edit_prompt_text(prompt, images, plus=False)
