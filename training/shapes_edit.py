"""The shapes world's edits (issue 31): instructions of a fixed grammar on a picture of training/shapes.py, what
each one means, the held-out (instruction, input) pairs, and the meaning check that reads an edited image. numpy
only.

An instruction changes one attribute of (shape colour, shape, background) and keeps the other two (and the shape's
size and place):
    make the shape {colour}          a colour that is neither the shape's nor the background's
    make the background {colour}     likewise
    turn the {shape} into a {shape}  the first names the picture's shape, the second another one
"""

from __future__ import annotations

import re

import numpy as np

from training.shapes import PALETTE, SHAPES, TRIPLES, read_image

SHAPE_COLOUR, BACKGROUND, SHAPE = "make the shape {}", "make the background {}", "turn the {} into a {}"
_FORMS = ((re.compile(r"make the shape (\w+)"), "colour"), (re.compile(r"make the background (\w+)"), "background"),
          (re.compile(r"turn the (\w+) into a (\w+)"), "shape"))


def instructions(triple: tuple[str, str, str]) -> list[str]:
    """Every instruction that makes sense on a picture of `triple` (each changes what it names)."""
    colour, shape, background = triple
    free = [c for c in PALETTE if c not in (colour, background)]
    return ([SHAPE_COLOUR.format(c) for c in free] + [BACKGROUND.format(c) for c in free]
            + [SHAPE.format(shape, s) for s in SHAPES if s != shape])


def apply(instruction: str, triple: tuple[str, str, str]) -> tuple[str, str, str]:
    """The (colour, shape, background) the instruction makes of `triple`; ValueError for one outside the grammar or
    one that does not apply to this picture (a colour it already has, a shape it is not)."""
    if instruction not in instructions(triple):
        raise ValueError(f"not an instruction of the edit grammar for {triple}: {instruction!r}")
    colour, shape, background = triple
    for pattern, what in _FORMS:
        m = pattern.fullmatch(instruction)
        if m and what == "colour":
            return m[1], shape, background
        if m and what == "background":
            return colour, shape, m[1]
        if m:
            return colour, m[2], background
    raise AssertionError(instruction)   # pragma: no cover - instructions() lists only the three forms


PAIRS = tuple((i, t) for t in TRIPLES for i in instructions(t))   # 168 pictures x 14 instructions = 2352

# Held out of training: one pair in ten, drawn once with a fixed seed and balanced over the three forms (every
# instruction and every picture still occurs in training with other partners, so the check asks for new pairings
# of known instructions and pictures).
_rng = np.random.default_rng(31)
HELD_OUT = tuple(sorted((PAIRS[k] for k in _rng.permutation(len(PAIRS))[:len(PAIRS) // 10]), key=PAIRS.index))
_held = set(HELD_OUT)
TRAIN = tuple(p for p in PAIRS if p not in _held)
del _rng, _held


def form(instruction: str) -> str:
    """Which attribute an instruction changes: colour, background or shape."""
    return next(what for pattern, what in _FORMS if pattern.fullmatch(instruction))


def check_pairs(n: int, pairs=HELD_OUT) -> list[tuple[str, tuple[str, str, str]]]:
    """n pairs spread over `pairs` (every k-th), the three forms each among them: what a meaning check runs."""
    step = max(1, len(pairs) // n)
    return list(pairs[::step][:n])


def edited_as_told(img: np.ndarray, instruction: str, triple: tuple[str, str, str]) -> bool:
    """Whether the image shows the input `triple` edited as told: the named attribute changed to the named value,
    the other two kept (training/shapes.read_image reads the three)."""
    return read_image(img) == apply(instruction, triple)
