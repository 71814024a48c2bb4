"""Condition images in a Qwen-VL prompt (host side, Python ints): the processor's <|image_pad|> expansion and the
language model's mRoPE positions of the tokens, as transformers computes them for Qwen2.5-VL and Qwen3-VL alike
(their get_rope_index agree for still images): an input of every text encoder graph that reads images."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qic.errors import ConfigError

IMAGE_PAD = "<|image_pad|>"


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
