"""The shapes world (training/shapes.py): every prompt's picture reads back as that prompt, at every
training resolution and size, through noise; and a picture of something else does not."""

from __future__ import annotations

import numpy as np
import pytest

from training.shapes import (
    HELD_OUT,
    PALETTE,
    SHAPES,
    SIZE_RANGE,
    TRAIN,
    TRIPLES,
    means,
    parse_prompt,
    prompt_of,
    read_image,
    render,
    sample,
)

RESOLUTIONS = ((128, 128), (96, 160), (160, 96))   # (height, width) the model is trained at


def test_the_held_out_split_is_fixed_valid_and_over_ten_percent():
    assert len(TRIPLES) == 8 * 7 * 3 and len(set(HELD_OUT)) == len(HELD_OUT) and set(HELD_OUT) <= set(TRIPLES)
    assert len(HELD_OUT) >= 0.1 * len(TRIPLES) and not set(HELD_OUT) & set(TRAIN)
    # each word is held out in some triple and trained in others: new combinations, never new words
    for word in (*PALETTE, *SHAPES):
        assert any(word in t for t in HELD_OUT) and any(word in t for t in TRAIN), word


@pytest.mark.parametrize("height,width", RESOLUTIONS)
def test_every_triple_reads_back_at_every_size(height, width):
    wrong = []
    for triple in TRIPLES:
        for size in (SIZE_RANGE[0], sum(SIZE_RANGE) / 2, SIZE_RANGE[1]):
            got = read_image(render(*triple, height, width, size))
            if got != triple:
                wrong.append((triple, size, got))
    assert not wrong, wrong[:5]


def test_it_still_reads_through_noise_a_model_might_leave():
    rng = np.random.default_rng(0)
    for i in range(200):
        prompt, img = sample(rng, *RESOLUTIONS[i % 3])
        noisy = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)   # std 12 of 255
        assert means(noisy, prompt), (prompt, read_image(noisy))


def test_a_picture_of_something_else_fails_the_check():
    img = render("red", "circle", "blue", 128, 128, 0.55)
    assert means(img, "a red circle on a blue background")
    assert not means(img, "a red square on a blue background")       # shape
    assert not means(img, "a blue circle on a red background")       # colours swapped
    assert not means(img[..., ::-1], "a red circle on a blue background")   # channels swapped (BGR)
    noise = np.random.default_rng(1).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    assert not means(noise, "a red circle on a blue background")
    flat = np.full((96, 160, 3), PALETTE["green"], np.uint8)
    assert read_image(flat)[1] == "none"


def test_prompts_round_trip_and_others_are_refused():
    for triple in TRIPLES:
        assert parse_prompt(prompt_of(*triple)) == triple
    for bad in ("a red circle on a red background", "a red hexagon on a blue background", "draw a cat"):
        with pytest.raises(ValueError):
            parse_prompt(bad)
