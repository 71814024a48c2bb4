"""Server settings, kept apart from the app so that `qic serve` checks flags before importing torch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qic.errors import ConfigError

# A served name (a weight set's model, an adapter): what a request's field holds.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class Settings:
    queue: int = 16          # images waiting beyond the batch running; more get 429
    timeout: float = 300.0   # seconds from arrival to the image, queueing included; 504 after
    max_n: int = 4           # images per request
    max_batch: int = 8       # largest batch of compatible images run together (if the bundle has the graphs)


def named_values(values, flag: str, what: str, own: str = "") -> tuple[list[str], dict[str, str]]:
    """Repeated `flag NAME=PATH` values (qic serve's --weights, --lora): (the values that name nothing: no '=', or no
    NAME before it; {name: path} of the others), each name once, never `own` (the served bundle's model name), each
    with a path (`what`: what it names, for the message)."""
    unnamed, named = [], {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not NAME.fullmatch(name):
            unnamed.append(value)
            continue
        if name in named:
            raise ConfigError(f"{flag} {value}: the name {name!r} is given twice")
        if own and name == own:
            raise ConfigError(f"{flag} {value}: {name!r} is the served bundle's own model name",
                              "give the set another name")
        if not path:
            raise ConfigError(f"{flag} {value}: no {what} after {name}=")
        named[name] = path
    return unnamed, named


def parse_adapters(values) -> dict[str, str]:
    """qic serve's `--lora NAME=FILE` values: {name: file}, each name once."""
    unnamed, named = named_values(values, "--lora", "adapter file")
    if unnamed:
        raise ConfigError(f"--lora {unnamed[0]}: give NAME=FILE (the name requests use: letters, digits and _.:- ; "
                          "and the adapter's file)")
    return named
