"""Aspect-ratio presets and picking a bundle resolution by aspect ratio.

The names are the Qwen-Image model card's official resolutions, written width:height as users say
them; qic stores resolutions as (height, width).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from qic.errors import ConfigError

# name (width:height) -> (height, width)
PRESETS = {"1:1": (1328, 1328), "16:9": (928, 1664), "9:16": (1664, 928), "4:3": (1104, 1472),
           "3:4": (1472, 1104), "3:2": (1056, 1584), "2:3": (1584, 1056)}
# The presets round sides to multiples of 16 (16:9 is 1664/928 = 1.793, not 1.778): a bundle resolution
# counts as an aspect ratio when its width/height is within 1.5% of it (the worst preset is 0.9% off).
_TOLERANCE = 0.015


def ratio(name: str, source: str = "--aspect") -> Fraction:
    """'W:H' -> width/height, for the presets and for any other ratio such as '5:3'."""
    try:
        w, h = (int(x) for x in str(name).split(":"))
        if w <= 0 or h <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{source}: aspect {name!r} is not of the form W:H (e.g. 16:9)",
                          f"presets: {', '.join(PRESETS)}") from None
    return Fraction(w, h)


def pick_resolution(name: str, resolutions: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bundle resolution (height, width) of aspect W:H: the preset itself if built, else the largest
    resolution within tolerance of the ratio."""
    if name in PRESETS and tuple(PRESETS[name]) in [tuple(r) for r in resolutions]:
        return tuple(PRESETS[name])
    want = float(ratio(name))
    fits = [tuple(r) for r in resolutions if abs(r[1] / r[0] / want - 1) <= _TOLERANCE]
    if not fits:
        have = ", ".join(f"{h}x{w} ({_name(h, w)})" for h, w in resolutions)
        raise ConfigError(f"--aspect {name}: this bundle has no resolution of that aspect ratio (it has: {have})",
                          f"rebuild with --resolution {name}" if name in PRESETS else "pick one of those")
    return max(fits, key=lambda r: r[0] * r[1])


def _name(height: int, width: int) -> str:
    f = Fraction(width, height)
    return f"{f.numerator}:{f.denominator}"
