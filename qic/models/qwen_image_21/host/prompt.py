"""Qwen-Image-2.1's prompt text as QwenImage21Pipeline hands it to its processor (host side): the system message
whose tokens the pipeline drops (its `_drop_idx`), the t2i / ti2i templates, the processor's <|image_pad|>
expansion, and the text encoder's mRoPE positions of the tokens (an input of its images graph)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qic.errors import ConfigError

# The pipeline's system prompt. Its `_drop_idx` is the token count of the system message as the processor's chat
# template renders it; Qwen chat templates render a system message as SYSTEM_MESSAGE (2.1's own processor files
# were not found, so that is Qwen3-VL's published template, not checked against 2.1's). It is also the prefix of
# every prompt_text, ending before a special token, so tokenizing it alone splits it as inside the prompt.
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_MESSAGE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"

IMAGE_PAD = "<|image_pad|>"


def prompt_text(prompt: str, n_images: int = 0) -> str:
    """The text the pipeline hands its processor for one prompt: the t2i template, or with condition images the
    ti2i one, image i announced as "<image{i}>" and held by one <|image_pad|> (the processor expands it to the
    image's token count: expand_image_pads). An empty prompt becomes " " (Qwen has no bos token)."""
    head = f"{SYSTEM_MESSAGE}<|im_start|>user\n"
    images = " ".join(f"<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>" for i in range(1, n_images + 1))
    return f"{head}{images}{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n"


def expand_image_pads(text: str, grids: Sequence[tuple[int, int, int]], merge_size: int) -> str:
    """The processor's expansion: the i-th <|image_pad|> becomes t*h*w / merge^2 of them (grid i in patches)."""
    parts = text.split(IMAGE_PAD)
    if len(parts) - 1 != len(grids):
        raise ConfigError(f"{len(parts) - 1} {IMAGE_PAD} in the text, {len(grids)} image grids")
    out = parts[0]
    for (t, h, w), rest in zip(grids, parts[1:]):
        out += IMAGE_PAD * (t * h * w // merge_size ** 2) + rest
    return out


def mrope_positions(input_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
                    merge_size: int, length: int | None = None) -> torch.Tensor:
    """[3, length] int64 mRoPE positions (temporal, height, width) of one token sequence, as transformers'
    get_rope_index computes them for its valid tokens: text runs count on from the current position on all three
    axes; image i (grid (t, h, w) in patches, one run of t*(h/m)*(w/m) image tokens) takes start + (frame,
    row, col) of its merged grid, and the next token starts at start + max(h, w) / m.

    Python ints only: a bucket-time constant (the images precede the prompt in 2.1's template, so the layout
    does not depend on the prompt). Positions past len(input_ids), up to `length` (the bucket), continue as
    text: right padding that causal attention hides from the valid tokens."""
    ids = list(input_ids)
    length = len(ids) if length is None else length
    if length < len(ids):
        raise ConfigError(f"{len(ids)} tokens do not fit a bucket of {length}")
    rows: list[list[int]] = [[], [], []]
    grids = list(grids)
    pos, i, used = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            for r in rows:
                r.append(pos)
            pos, i = pos + 1, i + 1
            continue
        if used == len(grids):
            raise ConfigError(f"more <|image_pad|> runs than the {len(grids)} image grids given")
        t, h, w = grids[used]
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if ids[i:i + n] != [image_token_id] * n or (i + n < len(ids) and ids[i + n] == image_token_id):
            raise ConfigError(f"image {used}: its run of <|image_pad|> tokens is not t*h*w/merge^2 = {n} long")
        for f in range(t):
            for y in range(gh):
                for x in range(gw):
                    rows[0].append(pos + f)
                    rows[1].append(pos + y)
                    rows[2].append(pos + x)
        pos += max(h, w) // merge_size
        i += n
        used += 1
    if used != len(grids):
        raise ConfigError(f"{len(grids)} image grids given, {used} <|image_pad|> runs found")
    for _ in range(length - len(ids)):
        for r in rows:
            r.append(pos)
        pos += 1
    return torch.tensor(rows, dtype=torch.long)
