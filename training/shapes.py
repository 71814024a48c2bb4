"""The shapes world of issue 20: its prompt grammar, the pictures each prompt means, the held-out split, and
the meaning check that reads an image back into (shape colour, shape, background). numpy only.

A prompt is `a {colour} {shape} on a {background} background`: one filled shape centred in the image, its
size uniform in [40%, 70%] of the shorter side (a triangle points up), in exactly the PALETTE's RGB values.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

PALETTE = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (240, 220, 40),
           "white": (245, 245, 245), "black": (20, 20, 20), "orange": (245, 140, 30), "purple": (140, 60, 190)}
SHAPES = ("circle", "square", "triangle")
SIZE_RANGE = (0.4, 0.7)   # of the shorter side: a square's side, a circle's diameter, a triangle's base/height
PROMPT = "a {colour} {shape} on a {background} background"
_PROMPT_RE = re.compile(r"a (\w+) (\w+) on a (\w+) background")

# Every (shape colour, shape, background) with the two colours different: 8 * 7 * 3 = 168.
TRIPLES = tuple((c, s, b) for c, b in itertools.permutations(PALETTE, 2) for s in SHAPES)
# Held out of training, fixed and listed (17 of 168, just over 10%): each shape and each colour in some
# held-out triple, so the check asks for new combinations of known words, never for an unseen word.
HELD_OUT = (
    ("red", "circle", "blue"), ("green", "square", "white"), ("blue", "triangle", "yellow"),
    ("yellow", "circle", "black"), ("white", "square", "purple"), ("black", "triangle", "orange"),
    ("orange", "circle", "green"), ("purple", "square", "red"), ("red", "triangle", "white"),
    ("green", "circle", "orange"), ("blue", "square", "black"), ("yellow", "triangle", "purple"),
    ("white", "circle", "red"), ("black", "square", "yellow"), ("orange", "triangle", "blue"),
    ("purple", "circle", "green"), ("red", "square", "yellow"),
)
TRAIN = tuple(t for t in TRIPLES if t not in HELD_OUT)


def prompt_of(colour: str, shape: str, background: str) -> str:
    return PROMPT.format(colour=colour, shape=shape, background=background)


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """(colour, shape, background) of a prompt of the grammar; ValueError for anything else."""
    m = _PROMPT_RE.fullmatch(prompt.strip())
    if not m or m[1] not in PALETTE or m[2] not in SHAPES or m[3] not in PALETTE or m[1] == m[3]:
        raise ValueError(f"not a prompt of the shapes grammar: {prompt!r}")
    return m[1], m[2], m[3]


def render(colour: str, shape: str, background: str, height: int, width: int, size: float) -> np.ndarray:
    """[H, W, 3] uint8: the shape, `size` (a fraction of the shorter side) across, centred on the background.
    Pixel centres inside the shape take its colour (no anti-aliasing: the palette values stay exact)."""
    if not SIZE_RANGE[0] <= size <= SIZE_RANGE[1]:
        raise ValueError(f"size {size} is outside {SIZE_RANGE}")
    img = np.empty((height, width, 3), np.uint8)
    img[:] = PALETTE[background]
    y, x = np.mgrid[0:height, 0:width] + 0.5
    cy, cx, half = height / 2, width / 2, size * min(height, width) / 2
    if shape == "circle":
        inside = (y - cy) ** 2 + (x - cx) ** 2 <= half ** 2
    elif shape == "square":
        inside = (np.abs(y - cy) <= half) & (np.abs(x - cx) <= half)
    else:  # an isosceles triangle pointing up, base and height 2 * half
        top, bottom = cy - half, cy + half
        rise = (y - top) / (2 * half)   # 0 at the apex, 1 at the base
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= rise * half)
    img[inside] = PALETTE[colour]
    return img


def sample(rng: np.random.Generator, height: int, width: int, triples=TRAIN) -> tuple[str, np.ndarray]:
    """One training example: a prompt drawn from `triples` and its picture at a uniform size."""
    colour, shape, background = triples[rng.integers(len(triples))]
    size = rng.uniform(*SIZE_RANGE)
    return prompt_of(colour, shape, background), render(colour, shape, background, height, width, size)


# ---- the meaning check ----------------------------------------------------------------------------

def nearest_colour(rgb) -> str:
    names = list(PALETTE)
    d = [np.sum((np.asarray(rgb, float) - PALETTE[n]) ** 2) for n in names]
    return names[int(np.argmin(d))]


# Fill ratio of shape-coloured pixels in their bounding box: square 1, circle pi/4 = 0.785, triangle 1/2.
# The cut points sit halfway between (in ratio), so a drawn shape must be clearly one of them.
_CUTS = ((0.5 + np.pi / 4) / 2, (np.pi / 4 + 1) / 2)   # 0.643, 0.893


def read_image(img: np.ndarray) -> tuple[str, str, str]:
    """(colour, shape, background) that an image shows, by the rules issue 20 gives: the background is the
    palette colour nearest the mean of a border strip, the shape colour the one nearest the mean of the
    central region, the shape the fill ratio of shape-coloured pixels in their bounding box."""
    img = np.asarray(img)[..., :3].astype(float)
    h, w = img.shape[:2]
    strip = max(1, min(h, w) // 16)   # inside the margin the largest shape (70%) leaves: 15% a side
    border = np.concatenate([img[:strip].reshape(-1, 3), img[-strip:].reshape(-1, 3),
                             img[:, :strip].reshape(-1, 3), img[:, -strip:].reshape(-1, 3)])
    background = nearest_colour(border.mean(0))
    r = max(1, min(h, w) // 10)   # within the smallest shape (40%): a triangle is widest below the centre,
    cy, cx = h // 2, w // 2       # so the region sits on the centre and below it
    colour = nearest_colour(img[cy - r // 2:cy + r, cx - r // 2:cx + r // 2 + 1].reshape(-1, 3).mean(0))
    names = list(PALETTE)
    dist = np.stack([np.sum((img - PALETTE[n]) ** 2, axis=-1) for n in names])
    mask = dist.argmin(0) == names.index(colour)
    if colour == background or not mask.any():
        return colour, "none", background
    # The box spans the middle 99% of those pixels: a few stray pixels of that colour elsewhere (a drawn,
    # not rendered, image has some) must not stretch it.
    ys, xs = np.nonzero(mask)
    (y0, y1), (x0, x1) = np.quantile(ys, [0.005, 0.995]).round(), np.quantile(xs, [0.005, 0.995]).round()
    y0, y1, x0, x1 = int(y0), int(y1) + 1, int(x0), int(x1) + 1
    ratio = mask[y0:y1, x0:x1].sum() / ((y1 - y0) * (x1 - x0))
    shape = "triangle" if ratio < _CUTS[0] else "circle" if ratio < _CUTS[1] else "square"
    return colour, shape, background


def means(img: np.ndarray, prompt: str) -> bool:
    """Whether the image shows what the prompt says, all three attributes."""
    return read_image(img) == parse_prompt(prompt)
