"""Step caching's decisions on the host: the settings (flags, bundle defaults, serve fields) and, per row
(CFG branch x image), whether its middle blocks compute at a step. No torch: `qic build` checks the same
settings in a config's defaults.

Decisions, as diffusers' FirstBlockCache and cache-dit's DBCache make them, per row (each reference runs a
CFG branch as its own call with its own state: diffusers' cache_context("cond"/"uncond"), cache-dit's
separate CFG buffers; one row per image here, so an image's decisions never depend on its batch):
- a row's first step computes (there is nothing to compare with);
- `warmup` W: steps 0..W-1 compute (cache-dit's max_warmup_steps; diffusers has none: 0);
- `max_cached` K, `max_continuous` C (cache-dit's max_cached_steps / max_continuous_cached_steps; -1: no
  limit): a row that has cached K steps in all, or C in a row, computes;
- else it caches when diff <= threshold, diff = mean|r - r_prev| / mean|r_prev| over the image stream's
  residual after the first Fn blocks, r_prev the residual of the row's last computed step.
- `steps` (a static mask, cache-dit's steps computation mask): exactly those steps compute, for every row;
  the host then never reads a figure back from the device, so no step waits on a device-to-host copy.
threshold 0 and no mask: caching is off and the whole-step graph runs (the same image as without caching).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qic.errors import ConfigError
from qic.host.options import BY_NAME


@dataclass(frozen=True)
class CacheSettings:
    threshold: float = 0.0
    warmup: int = 0
    max_cached: int = -1
    max_continuous: int = -1
    steps: tuple[int, ...] | None = None   # a static mask: the step indices that compute

    @property
    def active(self) -> bool:
        return self.threshold > 0 or self.steps is not None

    def describe(self) -> str:
        if self.steps is not None:
            return "steps " + format_steps(self.steps)
        return (f"threshold {self.threshold:g}, warmup {self.warmup}, max cached {self.max_cached}, "
                f"max continuous {self.max_continuous}")


MAX_STEP = 100_000   # a mask names steps of one run; more than this is a typo, not a schedule


def parse_steps(value, source: str = "--cache-steps") -> tuple[int, ...]:
    """'0-7,9,12' (or a list of ints) -> the sorted step indices, each an integer in 0..MAX_STEP."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        items = [p.strip() for p in value.split(",") if p.strip()]
    else:
        raise ConfigError(f"{source} must be steps like '0-7,9,12' or a list of step indices, got {value!r}")
    out = set()
    for item in items:
        if isinstance(item, str):
            a, dash, b = item.partition("-")
            bounds = (a.strip(), b.strip()) if dash else (a.strip(), a.strip())
            ok = all(x.isdigit() and x.isascii() for x in bounds)
            low, high = (int(x) for x in bounds) if ok else (0, -1)
        else:
            ok = isinstance(item, int) and not isinstance(item, bool)
            low = high = item if ok else 0
        if not ok or not 0 <= low <= high <= MAX_STEP:
            raise ConfigError(f"{source}: {item!r} is not a step index or range in 0..{MAX_STEP} (e.g. 0-7,9,12)")
        out.update(range(low, high + 1))
    if not out:
        raise ConfigError(f"{source} must name at least one step, got {value!r}")
    return tuple(sorted(out))


def format_steps(steps) -> str:
    """(0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
    runs, out = [], []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    for a, b in runs:
        out.append(str(a) if a == b else f"{a}-{b}")
    return ",".join(out)


def settings_from(values: dict, source: str = "request") -> CacheSettings:
    """CacheSettings from cache_* values (None: not given), each checked by its row (qic.host.options) and named
    on error; cache_steps may be a list of step indices too (a build config's YAML)."""
    def number(key, default):
        v = BY_NAME[key].check(values.get(key), source)
        return default if v is None else v

    steps = values.get("cache_steps")
    return CacheSettings(threshold=number("cache_threshold", 0.0), warmup=number("cache_warmup", 0),
                         max_cached=number("cache_max_cached", -1),
                         max_continuous=number("cache_max_continuous", -1),
                         steps=None if steps is None else parse_steps(steps, f"{source}: cache_steps"))


@dataclass
class RowState:
    computed: list[int] = field(default_factory=list)   # steps whose middle blocks ran
    figures: list[float | None] = field(default_factory=list)   # each step's figure (None: not read)
    cached_total: int = 0
    cached_run: int = 0

    def decide(self, s: CacheSettings, step: int, diff: float | None) -> bool:
        """True: compute this step's middle blocks."""
        self.figures.append(diff if self.computed else None)   # no figure before a first computed step
        if s.steps is not None:
            compute = step in s.steps or not self.computed   # nothing cached before the first compute
        elif not self.computed or step < s.warmup:
            compute = True
        elif 0 <= s.max_cached <= self.cached_total or 0 <= s.max_continuous <= self.cached_run:
            compute = True
        else:
            compute = not diff <= s.threshold   # as the references: cache iff diff <= threshold (NaN computes)
        if compute:
            self.computed.append(step)
            self.cached_run = 0
        else:
            self.cached_total += 1
            self.cached_run += 1
        return compute


def computed_line(computed: list[list[int]], steps: int) -> str:
    """One image's rows as the run reports them: 'cond 12/20 (0-5,7,9-11,14,17,19), uncond 11/20 (...)'."""
    names = ("cond", "uncond") if len(computed) == 2 else ("steps",)
    return ", ".join(f"{name} {len(c)}/{steps} ({format_steps(c)})" for name, c in zip(names, computed))
