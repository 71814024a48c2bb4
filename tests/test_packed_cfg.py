"""Packed CFG (qic.models.qwen_image.graphs.packed_cfg): an exact-length step graph takes the prompt's and the
negative prompt's text at their own lengths, one transformer call over both branches' rows, instead of both padded
to the longer one with a mask. Checked against the padded form (the step every bucketed bundle runs, itself checked
against diffusers elsewhere), unrolled and looped, and by what each computes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qic.checkpoint.presets import preset
from qic.models.common import load_weights
from qic.models.looped import stack_block_weights
from qic.models.qwen_image.graphs import denoiser_graph
from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT
from tests.helpers import mmdit_bound, rel_l2, sensitize_

PRESET, VAE_SCALE, SIZE = "tiny", 8, (48, 80)
BUCKET = 34 + 40          # a bucket (template + 40 tokens) for the padded form: the denoiser sees 40 rows
COND, UNCOND = 27, 9      # the branches' own lengths, unequal as a prompt and " " are
# Packed and padded compute each token's row alike; what differs is the GEMMs' row blocking and the padded
# form's masked keys (exp(-inf) = 0 terms in the softmax sums): fp32 reordering, the same bound as the looped
# model against the unrolled one (tests/helpers.mmdit_bound: about 3e-5 for tiny).
TOL = mmdit_bound(PRESET)


def _models():
    config = MMDiTConfig.from_dict(preset(PRESET)["transformer"])
    ref = sensitize_(QwenMMDiT(config)).eval()
    looped = LoopedMMDiT(config).eval()
    load_weights(looped, stack_block_weights(ref.state_dict(), "transformer_blocks", config.num_layers), "transformer")
    return config, ref, looped


def _inputs(config, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    rows, cols = SIZE[0] // VAE_SCALE // 2, SIZE[1] // VAE_SCALE // 2
    latents = torch.randn(1, rows * cols, config.in_channels, generator=g)
    cond = torch.randn(1, COND, config.joint_attention_dim, generator=g)
    uncond = torch.randn(1, UNCOND, config.joint_attention_dim, generator=g)
    scalars = [torch.tensor(v) for v in (700.0, 0.7, 0.62, 4.0)]   # timestep, sigma, sigma_next, guidance
    return latents, cond, uncond, scalars


def _padded(cond, uncond, length):
    text = torch.zeros(2, length, cond.shape[2])
    mask = torch.zeros(2, length, dtype=torch.long)
    for row, t in enumerate((cond, uncond)):
        text[row, :t.shape[1]], mask[row, :t.shape[1]] = t[0], 1
    return text, mask


@pytest.mark.parametrize("layers", ["unrolled", "looped"])
def test_packed_step_equals_the_padded_step(layers):
    config, ref, looped = _models()
    model = ref if layers == "unrolled" else looped
    packed = denoiser_graph(model, config, VAE_SCALE, *SIZE, 0, "float32").module.eval()
    padded = denoiser_graph(ref, config, VAE_SCALE, *SIZE, BUCKET, "float32").module.eval()
    latents, cond, uncond, scalars = _inputs(config)
    with torch.no_grad():
        want = padded(latents, *_padded(cond, uncond, BUCKET - 34), *scalars)
        got = packed(latents, cond, uncond, *scalars)
        # The branches swapped (the negative prompt's text read as the prompt's): far off, so the bound can fail.
        swapped = packed(latents, uncond, cond, *scalars)
    err, off = rel_l2(got - latents, want - latents), rel_l2(swapped - latents, want - latents)
    print(f"{layers}: packed vs padded rel-L2 {err:.2e} (bound {TOL:.1e}); swapped {off:.2e}")
    assert err <= TOL
    assert off > 100 * TOL


def test_packed_step_computes_the_branches_at_their_own_lengths():
    """What the packed step computes is what the two branches' calls at their own lengths compute (diffusers'
    two transformer calls) less one call's timestep conditioning, below the padded form's, which computes the
    shorter branch at the longer's length."""
    config, ref, _ = _models()
    latents, cond, uncond, scalars = _inputs(config)

    def flops(module, *args):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            module(*args)
        return counter.get_total_flops()

    packed = flops(denoiser_graph(ref, config, VAE_SCALE, *SIZE, 0, "float32").module, latents, cond, uncond,
                   *scalars)
    single = denoiser_graph(ref, config, VAE_SCALE, *SIZE, 0, "float32", cfg=False).module
    branches = sum(flops(single, latents, t, torch.ones(1, t.shape[1], dtype=torch.long), *scalars[:3])
                   for t in (cond, uncond))
    bucketed = denoiser_graph(ref, config, VAE_SCALE, *SIZE, 34 + COND, "float32").module
    padded = flops(bucketed, latents, *_padded(cond, uncond, COND), *scalars)
    print(f"GFLOP: packed {packed / 1e9:.4f}, the branches alone {branches / 1e9:.4f}, padded {padded / 1e9:.4f}")
    # The two calls each compute the timestep embedding and every modulation ([1, D] rows); the packed step once.
    d = config.inner_dim
    conditioning = config.num_layers * 2 * (2 * d * 6 * d) + 2 * 256 * d + 2 * d * d + 2 * d * 2 * d
    assert branches - packed == conditioning
    assert packed < padded
