"""qic's MMDiT over [noise | condition] tokens (the Edit models' denoiser) against diffusers' transformer as
QwenImageEditPlusPipeline calls it: condition latents concatenated after the noise, img_shapes [output,
condition 1, ...], the prediction sliced to the noise tokens; with and without Edit-2511's zero_cond_t."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qic.checkpoint.presets import preset
from qic.models.common import load_weights
from qic.models.qwen_image.host.rope import rope_positions
from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT, mmdit_state_dict, position_tables, rope_tables
from tests.helpers import mmdit_bound, rel_l2, scheduler_at_step, sensitize_

TOL = mmdit_bound("tiny")   # fp32 summation-order bound; the ~40 tokens attended are far below its reduction length
GRID = (3, 5)                       # the output's packed grid (rows, cols), odd on purpose
CONDITIONS = ((4, 4), (2, 6))       # two condition images of other aspects; 4x4 is taller than the output
TXT = 7


@pytest.fixture(scope="module", params=[False, True], ids=["edit-plus", "zero-cond-t"])
def models(request):
    cfg = {**preset("tiny")["transformer"], "zero_cond_t": request.param}
    ref = sensitize_(QwenImageTransformer2DModel.from_config(cfg)).eval()
    config = MMDiTConfig.from_dict(cfg)
    ours = QwenMMDiT(config).eval()
    load_weights(ours, mmdit_state_dict(ref.state_dict()), "transformer")
    return ref, ours, config


def _inputs(config, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, GRID[0] * GRID[1], config.in_channels, generator=g)
    cond = torch.randn(batch, sum(h * w for h, w in CONDITIONS), config.in_channels, generator=g)
    text = torch.randn(batch, TXT, config.joint_attention_dim, generator=g)
    return noise, cond, text


def _ref(ref, noise, cond, text, mask, t, conditions=CONDITIONS):
    shapes = [[(1, *GRID), *((1, h, w) for h, w in conditions)]] * noise.shape[0]
    with torch.no_grad():
        out = ref(hidden_states=torch.cat([noise, cond], 1), encoder_hidden_states=text,
                  encoder_hidden_states_mask=mask, timestep=t, img_shapes=shapes, return_dict=False)[0]
    return out[:, :noise.shape[1]]


def test_rope_tables_of_several_images_match_diffusers(models):
    ref, _, config = models
    for grid, conds, n in [(GRID, CONDITIONS, TXT), ((6, 9), ((2, 2),), 3), ((2, 2), ((8, 3), (3, 8), (1, 1)), 5)]:
        img, txt = ref.pos_embed([[(1, *grid), *((1, h, w) for h, w in conds)]], max_txt_seq_len=n,
                                 device=torch.device("cpu"))
        want = torch.cat([txt, img], 0)
        cos, sin = rope_tables(config, *grid, n, conds)
        assert cos.shape == want.shape
        torch.testing.assert_close(cos, want.real, rtol=0, atol=1e-6)   # cos/sin implementations: a few ulp
        torch.testing.assert_close(sin, want.imag, rtol=0, atol=1e-6)


def test_condition_tokens_match_diffusers(models):
    ref, ours, config = models
    noise, cond, text = _inputs(config)
    t = torch.tensor([0.7, 0.3])
    mask = torch.ones(2, TXT, dtype=torch.long)
    mask[1, 4:] = 0
    cos, sin = rope_tables(config, *GRID, TXT, CONDITIONS)
    with torch.no_grad():
        for m in (None, mask):
            want = _ref(ref, noise, cond, text, m, t)
            got = ours(noise, text, m, t, cos, sin, condition=cond)
            assert got.shape == want.shape == noise.shape[:2] + (config.out_features,)
            err = rel_l2(got, want)
            print(f"zero_cond_t={config.zero_cond_t}, mask {m is not None}: rel-L2 {err:.1e}")
            assert err <= TOL


def test_padded_condition_slots_change_nothing(models):
    """One graph serves fewer condition tokens than its capacity: the spare slots are keys masked out (their
    values and positions anything), as padded text is."""
    _, ours, config = models
    noise, cond, text = _inputs(config)
    t = torch.tensor([0.6, 0.6])
    cos, sin = rope_tables(config, *GRID, TXT, CONDITIONS)
    spare = 5
    g = torch.Generator().manual_seed(3)
    padded = torch.cat([cond, 100 * torch.randn(2, spare, config.in_channels, generator=g)], 1)
    slot_mask = torch.cat([torch.ones(2, cond.shape[1]), torch.zeros(2, spare)], 1)
    cos_p, sin_p = (torch.cat([x, x[-spare:]], 0) for x in (cos, sin))
    with torch.no_grad():
        exact = ours(noise, text, None, t, cos, sin, condition=cond)
        assert rel_l2(ours(noise, text, None, t, cos_p, sin_p, condition=padded, condition_mask=slot_mask),
                      exact) <= TOL
        # unmasked, the same spare slots are seen
        assert rel_l2(ours(noise, text, None, t, cos_p, sin_p, condition=padded), exact) > 100 * TOL


def test_the_check_fails_without_conditions_with_a_wrong_frame_or_zero_cond_t_ignored(models):
    ref, ours, config = models
    noise, cond, text = _inputs(config)
    t = torch.tensor([0.7, 0.3])
    want = _ref(ref, noise, cond, text, None, t)
    cos, sin = rope_tables(config, *GRID, TXT, CONDITIONS)
    pos = rope_positions(*GRID, TXT, CONDITIONS)
    pos[TXT + GRID[0] * GRID[1]:, 0] = 0   # every condition image at the output's frame 0
    cos0, sin0 = position_tables(config, pos)
    with torch.no_grad():
        variants = {
            "conditions left out": ours(noise, text, None, t, *rope_tables(config, *GRID, TXT)),
            "conditions at frame 0": ours(noise, text, None, t, cos0, sin0, condition=cond),
        }
        if config.zero_cond_t:
            plain = QwenMMDiT(MMDiTConfig.from_dict(preset("tiny")["transformer"])).eval()
            plain.load_state_dict(ours.state_dict())
            variants["zero_cond_t ignored"] = plain(noise, text, None, t, cos, sin, condition=cond)
    for label, got in variants.items():
        err = rel_l2(got, want)
        print(f"zero_cond_t={config.zero_cond_t}, {label}: rel-L2 {err:.1e}")
        assert err > 100 * TOL, label


def test_zero_cond_t_without_conditions_is_the_plain_model(models):
    """A 2511 checkpoint drawing from text alone: diffusers' [t, 0] batch leaves every token at t."""
    ref, ours, config = models
    noise, _, text = _inputs(config)
    t = torch.tensor([0.5, 0.2])
    with torch.no_grad():
        want = ref(hidden_states=noise, encoder_hidden_states=text, encoder_hidden_states_mask=None, timestep=t,
                   img_shapes=[[(1, *GRID)]] * 2, return_dict=False)[0]
        assert rel_l2(ours(noise, text, None, t, *rope_tables(config, *GRID, TXT)), want) <= TOL


def test_the_looped_form_reads_conditions_as_the_unrolled_one(models):
    """The scan carries zero_cond_t's timestep-0 embedding and token choice as invariants of every block."""
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image.mmdit import LoopedMMDiT
    _, ours, config = models
    looped = LoopedMMDiT(config).eval()
    load_weights(looped, stack_block_weights(ours.state_dict(), "transformer_blocks", config.num_layers),
                 "transformer")
    noise, cond, text = _inputs(config)
    t = torch.tensor([0.7, 0.3])
    cos, sin = rope_tables(config, *GRID, TXT, CONDITIONS)
    mask = torch.ones(2, cond.shape[1])
    mask[1, -3:] = 0
    with torch.no_grad():
        assert rel_l2(looped(noise, text, None, t, cos, sin, condition=cond, condition_mask=mask),
                      ours(noise, text, None, t, cos, sin, condition=cond, condition_mask=mask)) <= TOL


def test_a_whole_edit_step_is_the_pipelines(models):
    """DenoiseStep with conditions against QwenImageEditPlusPipeline's loop body: each branch's transformer call on
    [latents | image latents] sliced to the latents, true CFG with its norm rescale, the scheduler's Euler step."""
    from qic.models.qwen_image.step import DenoiseStep
    ref, ours, config = models
    noise, cond, _ = _inputs(config, batch=1)
    g = torch.Generator().manual_seed(4)
    pos, neg = (torch.randn(1, n, config.joint_attention_dim, generator=g) for n in (TXT, 4))
    sched, i = scheduler_at_step(noise.shape[1])
    t = sched.timesteps[i]
    ts = t.expand(1).to(noise.dtype) / 1000
    cond_pred, neg_pred = (_ref(ref, noise, cond, e, None, ts) for e in (pos, neg))
    comb = neg_pred + 4.0 * (cond_pred - neg_pred)
    v = comb * (torch.norm(cond_pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    want = sched.step(v, t, noise, return_dict=False)[0]
    # text rows padded to one length, as a bundle's bucket pads them: [prompt | negative], masked
    text = torch.zeros(2, TXT, config.joint_attention_dim)
    text[0], text[1, :4] = pos[0], neg[0]
    mask = torch.zeros(2, TXT, dtype=torch.long)
    mask[0], mask[1, :4] = 1, 1
    sigma, sigma_next = sched.sigmas[i], sched.sigmas[i + 1]
    cos, sin = rope_tables(config, *GRID, TXT, CONDITIONS)
    with torch.no_grad():
        got = DenoiseStep(ours)(noise, text, mask, t, sigma, sigma_next, torch.tensor(4.0), cos, sin,
                                condition=cond, condition_mask=torch.ones(1, cond.shape[1]))
        err = rel_l2(got, want)
        # and without the conditions the step is another one
        other = DenoiseStep(ours)(noise, text, mask, t, sigma, sigma_next, torch.tensor(4.0),
                                  *rope_tables(config, *GRID, TXT))
    print(f"zero_cond_t={config.zero_cond_t}: edit step rel-L2 {err:.1e}")
    assert err <= TOL
    assert rel_l2(other, want) > 100 * TOL
