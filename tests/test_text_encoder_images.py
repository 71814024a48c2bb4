"""qic's Qwen2.5-VL language model reading condition images (the Edit models' prompts) against transformers'
Qwen2_5_VLForConditionalGeneration with pixel values, fp32 on CPU: the vision tower's features written over the
<|image_pad|> tokens, and mRoPE's 3-D positions for them (qic.host.image_tokens.mrope_positions).

The reference gets `mm_token_type_ids`: transformers 5 computes Qwen2.5-VL's 3-D positions only from it, and
diffusers 0.42's edit pipelines do not pass it, so with transformers 5 they silently run image tokens at 1-D
positions (diffusers issue 14194, fix in PR 14189 open); the models were trained with transformers 4.x's 3-D
positions, which is what qic computes. The pipeline-level parity tests patch the same argument in."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from qic.checkpoint.presets import preset
from qic.host.image_tokens import mrope_positions
from qic.models.common import load_weights
from qic.models.qwen_image.text_encoder import QwenTextEncoder, TextEncoderConfig, text_encoder_state_dict
from qic.models.qwen_image.vision import QwenImageVision, VisionConfig, vision_state_dict
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_, text_encoder_bound

CONFIG = preset("tiny")["text_encoder"]
START, END, PAD = CONFIG["vision_start_token_id"], CONFIG["vision_end_token_id"], CONFIG["image_token_id"]
GRIDS = [(1, 4, 6), (1, 8, 4)]   # (t, h, w) patches of two condition images of different aspect
PATCH = 3 * 2 * 14 * 14
# fp32 reordering (tests/helpers.py): the language model's bound, and the vision tower's in front of it (its
# features are the image tokens' embeddings): about seven reductions a block, each at most a patch's inputs long
BOUND = math.hypot(text_encoder_bound("tiny"),
                   fp32_reorder_bound(PATCH, 7 * CONFIG["vision_config"]["depth"] + 4))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = sensitize_(Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CONFIG)).eval())
    state = ref.state_dict()
    encoder = QwenTextEncoder(TextEncoderConfig.from_dict(CONFIG)).eval()
    load_weights(encoder, text_encoder_state_dict(state), "text_encoder")
    vision = QwenImageVision(VisionConfig.from_dict(CONFIG)).eval()
    load_weights(vision, vision_state_dict(state), "vision")
    return ref, encoder, vision


def _prompt(seed: int = 0, grids=GRIDS) -> list[int]:
    """Text, then each image as <|vision_start|> <|image_pad|> x its tokens <|vision_end|> with text between, as
    the Edit Plus template lays them out ("Picture i: ..."), then the prompt."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, 1000, (n,), generator=g).tolist()   # below the special ids

    ids = text(5)
    for _, h, w in grids:
        ids += text(3) + [START] + [PAD] * (h * w // 4) + [END]
    return ids + text(9)


def _pixels(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, PATCH, generator=g) for t, h, w in GRIDS]


def _reference(ref, ids, mask, pixels):
    """pixels: every row's images in order (the rows' grids are GRIDS each)."""
    grids = torch.tensor(GRIDS * (len(pixels) // len(GRIDS)))
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pixels), image_grid_thw=grids,
                  mm_token_type_ids=(ids == PAD).int(), output_hidden_states=True)
    return out.hidden_states[-1]   # what the edit pipelines read (the final norm's output)


def _ours(encoder, vision, ids, mask, pixels, positions=True, images=True):
    feats = torch.cat([vision(p, (h, w)) for p, (_, h, w) in zip(pixels, GRIDS)]) if images else None
    pos = mrope_positions(ids[0].tolist(), PAD, GRIDS, 2) if positions else None
    with torch.no_grad():
        return encoder(ids, mask, pos, feats)


@pytest.fixture(scope="module")
def one_prompt(models):
    """One prompt with the two images, unpadded: (ids, mask, pixels, the reference's hidden states)."""
    ids = torch.tensor([_prompt()])
    mask = torch.ones_like(ids)
    pixels = _pixels()
    return ids, mask, pixels, _reference(models[0], ids, mask, pixels)


def test_images_in_the_prompt_match_transformers(models, one_prompt):
    _, encoder, vision = models
    ids, mask, pixels, want = one_prompt
    got = _ours(encoder, vision, ids, mask, pixels)
    err = rel_l2(got, want)
    print(f"rel-L2 {err:.1e} (bound {BOUND:.1e})")
    assert got.shape == want.shape and err <= BOUND


def test_the_check_fails_at_1d_positions_without_features_or_with_patches_shuffled(models, one_prompt):
    _, encoder, vision = models
    ids, mask, pixels, want = one_prompt
    same_size = [p[torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(5))] for p in pixels]
    variants = {
        "1-D positions (diffusers 0.42, transformers 5)": _ours(encoder, vision, ids, mask, pixels, positions=False),
        "no image features": _ours(encoder, vision, ids, mask, pixels, images=False),
        "patches shuffled within each image": _ours(encoder, vision, ids, mask, same_size),
    }
    for label, got in variants.items():
        err = rel_l2(got, want)
        print(f"{label}: rel-L2 {err:.1e}")
        assert err > 100 * BOUND, label


def test_text_only_is_unchanged(models):
    """Without position_ids and image_embeds the encoder is the text-to-image one: plain RoPE, no slots."""
    ref, encoder, _ = models
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        got = encoder(ids, mask)
        # the mRoPE path with text positions (all three axes alike) is the same arithmetic
        text_pos = mrope_positions(ids[0].tolist(), PAD, [], 2)
        assert rel_l2(encoder(ids, mask, text_pos), got) <= text_encoder_bound("tiny")
    assert rel_l2(got, want) <= text_encoder_bound("tiny")


def test_exports_with_images(models):
    _, encoder, vision = models
    ids = torch.tensor([_prompt()])
    mask = torch.ones_like(ids)
    feats = torch.cat([vision(p, (h, w)) for p, (_, h, w) in zip(_pixels(), GRIDS)]).detach()
    pos = mrope_positions(ids[0].tolist(), PAD, GRIDS, 2)
    program = torch.export.export(encoder, (ids, mask, pos, feats))
    with torch.no_grad():
        assert torch.equal(program.module()(ids, mask, pos, feats), encoder(ids, mask, pos, feats))


def test_a_batch_with_a_right_padded_row(models):
    """Prompt and negative prompt as the pipeline batches them: the same images in the same place, the second row
    shorter and right-padded; positions shared by the rows, the valid tokens compared."""
    ref, encoder, vision = models
    ids = torch.tensor([_prompt(0), _prompt(3)])
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    pixels = _pixels()
    want = _reference(ref, ids, mask, pixels + pixels)
    got = _ours(encoder, vision, ids, mask, pixels)
    valid = mask.bool()
    err = rel_l2(got[valid], want[valid])
    print(f"batch of 2, row 2 padded: rel-L2 {err:.1e}")
    assert err <= BOUND
