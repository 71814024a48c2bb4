"""The per-image run options, one row each. Everything that takes them is made from this table: `qic run`'s
flags, the keys and types a prompts-file line may carry, the HTTP request model of `qic serve`, the
runtime's `Request`, the keys of a bundle's run `defaults` and their checks. A new option is a new row.

No torch and no click or pydantic here (the CLI and the server build their own objects from the rows), so
`qic build` can check a config's defaults with it and the runtime can import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass

from qic.errors import ConfigError

# Where an option can be given: `qic run`'s flags, a prompts-file line, a serve request body.
FLAG, LINE, HTTP = "flag", "line", "http"
EVERYWHERE = frozenset((FLAG, LINE, HTTP))
NOT_HTTP = frozenset((FLAG, LINE))   # the request's `size` names the resolution; the server writes no file


@dataclass(frozen=True)
class RunOption:
    name: str                     # the Request field, the JSONL key and the HTTP field; the flag is --name-with-dashes
    kind: type                    # int, float, str, bool, or list (of strings; a line may give one string; the flag
    #                               repeats) (a float option takes integers too, as JSON and YAML write them)
    help: str
    default: object = None        # None: not given (then the bundle's run default, where it may have one)
    minimum: float | None = None  # value >= minimum
    below: float | None = None    # value < below
    nullable: bool = False        # null is a value of its own (negative_prompt: no negative prompt, so no CFG)
    bundle_default: bool = False  # a bundle's `defaults` may set it (qic build's config; qic run and serve use it)
    where: frozenset = EVERYWHERE
    request: bool = True          # a field of the runtime's Request (output is qic run's alone)
    what: str = ""                # how an error names the type ("a file path"); default from kind
    required: bool = False        # every request has it (the prompt)
    # Taken only by the host programs that name it (request_class's `only`): a family's own option (2.1's
    # kv_cache); the others' Requests lack it, so `qic run` refuses it on their bundles in one line.
    opt_in: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def describe(self) -> str:
        """'an integer >= 1', 'a finite number >= 0', 'a string or null', ..."""
        text = self.what or {int: "an integer", float: "a finite number", str: "a string",
                             bool: "true or false", list: "a string or a list of strings"}[self.kind]
        if self.minimum is not None and self.below is not None:
            text += f" in [{_num(self.minimum)}, {_num(self.below)})"
        elif self.minimum is not None:
            text += f" >= {_num(self.minimum)}"
        if self.kind is str and self.minimum:
            text = "a non-empty string"
        return text + (" or null" if self.nullable else "")

    def check(self, value, source: str = "") -> object:
        """`value` if it is of this option's type and range (None: not given), else a ConfigError naming it.
        Booleans are not numbers, "3" is not an integer, 3.5 not a step count; a float option takes an int."""
        if value is None and not self.required:
            return None
        if self.kind is list:   # one string, or a non-empty list of non-empty strings
            items = [value] if isinstance(value, str) else value
            ok = isinstance(items, (list, tuple)) and bool(items) and all(isinstance(v, str) and v for v in items)
            if ok:
                return list(items)
        kinds = (int, float) if self.kind is float else (self.kind,)
        ok = self.kind is not list and isinstance(value, kinds) and (self.kind is bool) == isinstance(value, bool)
        if ok and self.kind is float:
            ok = math.isfinite(value)
        if ok and self.kind is str:
            ok = len(value) >= (self.minimum or 0)
        elif ok and self.kind is not bool:
            ok = (self.minimum is None or value >= self.minimum) and (self.below is None or value < self.below)
        if not ok:
            where = f"{source}: " if source else ""
            raise ConfigError(f"{where}{self.name} must be {self.describe()}, got {value!r}")
        return float(value) if self.kind is float else value


def _num(x: float) -> str:
    return "2**63" if x == 2**63 else f"{x:g}"


CACHE_HELP = "Step caching (a bundle built with --step-cache): "
OPTIONS: tuple[RunOption, ...] = (
    RunOption("prompt", str, "What to draw.", minimum=1, required=True),
    RunOption("negative_prompt", str, "What to steer away from (true CFG); default ' ' (null in a prompts-file "
              "line or request: none, so no CFG).", default=" ", nullable=True),
    RunOption("steps", int, "Denoising steps (default: the bundle's, else 20).", minimum=1, below=1001,
              bundle_default=True),
    RunOption("guidance", float, "True CFG scale; <= 1 turns CFG off (default: the bundle's, else 4.0).",
              minimum=0, bundle_default=True),
    # torch's generator takes 64 bits; the bound below 2**63 is the HTTP API's too, so that the same seed is
    # accepted, or refused, by `qic run` and `qic serve` alike.
    RunOption("seed", int, "Noise seed (default 0).", default=0, minimum=0, below=2**63),
    RunOption("height", int, "Image height; one of the bundle's resolutions.", where=NOT_HTTP),
    RunOption("width", int, "Image width; one of the bundle's resolutions.", where=NOT_HTTP),
    RunOption("aspect", str, "Width:height, e.g. 16:9: the bundle's resolution of that aspect ratio.",
              where=NOT_HTTP, what="a string such as 16:9"),
    RunOption("output", str, "PNG file to write (default image.png).", where=NOT_HTTP, request=False,
              what="a file path (a string)"),
    RunOption("cache_threshold", float, CACHE_HELP + "reuse the middle blocks' residual when the first blocks' "
              "changed by at most this (relative L1; 0: off).", minimum=0, bundle_default=True),
    RunOption("cache_warmup", int, CACHE_HELP + "steps that always compute first.", minimum=0, bundle_default=True),
    RunOption("cache_max_cached", int, CACHE_HELP + "most cached steps per branch (-1: any).", minimum=-1,
              bundle_default=True),
    RunOption("cache_max_continuous", int, CACHE_HELP + "most cached steps in a row per branch (-1: any).",
              minimum=-1, bundle_default=True),
    RunOption("cache_steps", str, CACHE_HELP + "a static mask, the steps that compute, e.g. 0-7,9,11,13 (no "
              "per-step read).", bundle_default=True, what="steps like '0-7,9'"),
    # Reference (condition) images: Qwen-Image-2.1's and the Edit models' (a bundle built with --condition-size).
    # Not JSON fields: images reach a server as files, through POST /v1/images/edits (qic.serve.app).
    RunOption("image", list, "Reference (condition) image file; repeat for several, in prompt order (bundles built "
              "with --condition-size: Qwen-Image-2.1, Qwen-Image-Edit 2509 / 2511).", where=NOT_HTTP, opt_in=True,
              what="an image file path or a list of them"),
    RunOption("nearest_condition_size", bool, "A condition image whose size the bundle was not built for is resized "
              "to the built condition size nearest its aspect instead of refused (the PNG's text records the sizes "
              "used).", where=NOT_HTTP, opt_in=True),
    # img2img (a Qwen-Image bundle built with the vae_encoder component): how far from the image --image gives.
    RunOption("strength", float, "img2img: how much of the image to redraw, 0 < strength <= 1 (the pipeline's "
              "default 0.6; 1: the image's only trace is its seed's noise); the run takes strength x steps steps.",
              minimum=0, where=NOT_HTTP, opt_in=True, bundle_default=True),
    RunOption("mask", str, "Inpaint (with --image, on a bundle with the VAE encoder): a mask image of the image's "
              "size, white where to repaint (as diffusers reads masks); the rest keeps the image.", where=NOT_HTTP,
              opt_in=True, what="an image file path"),
    RunOption("output_resolution", int, "Qwen-Image-2.1: condition images are resized to about its square in "
              "pixels at their aspect, and the output size follows the last one (default: the bundle's, else 1024).",
              minimum=32, where=NOT_HTTP, opt_in=True, bundle_default=True),
    # Per-request LoRA (a bundle built with --lora-slots); qic serve's body gives it as [{"name", "scale"}].
    RunOption("lora", list, "LoRA adapter for this image, FILE[:SCALE] (qic serve: a name given by its --lora "
              "NAME=FILE); repeat for several, applied together (bundles built with --lora-slots R: their ranks add "
              "up to at most R).", opt_in=True, what="NAME[:SCALE] strings or {name, scale} objects"),
    # qic serve serves the text-to-image program only, which does not take it: not an HTTP field yet.
    RunOption("kv_cache", bool, "Prefix K/V cache (Qwen-Image-2.1 bundles): --no-kv-cache runs the prefill at every "
              "step, as the pipeline's use_kv_cache=False.", where=NOT_HTTP, opt_in=True),
)
BY_NAME: dict[str, RunOption] = {}
REQUEST_OPTIONS: tuple[RunOption, ...] = ()
CACHE_FIELDS: tuple[str, ...] = ()
DEFAULT_KEYS: tuple[str, ...] = ()


def extend(*rows: RunOption) -> None:
    """Add run options (a model family's own). The CLI, the server and the runtime make their flags, request
    model and Request when they are imported, so rows are added before that."""
    global OPTIONS, BY_NAME, REQUEST_OPTIONS, CACHE_FIELDS, DEFAULT_KEYS
    table = (*OPTIONS, *rows)
    names = [o.name for o in table]
    if len(set(names)) != len(names):   # refused whole: the table stays as it was
        raise ValueError(f"run options named twice: {sorted({n for n in names if names.count(n) > 1})}")
    OPTIONS, BY_NAME = table, dict(zip(names, table))
    REQUEST_OPTIONS = tuple(o for o in OPTIONS if o.request)
    CACHE_FIELDS = tuple(o.name for o in OPTIONS if o.name.startswith("cache_"))
    DEFAULT_KEYS = tuple(o.name for o in OPTIONS if o.bundle_default)


extend()


def given_at(where: str) -> tuple[RunOption, ...]:
    return tuple(o for o in OPTIONS if where in o.where)


def check_all(values: dict, source: str = "") -> dict:
    """Each named option checked (an unknown name is the caller's to refuse first)."""
    return {k: BY_NAME[k].check(v, source) for k, v in values.items()}


def untaken(request_cls, values: dict) -> list[str]:
    """The request options in `values` at another value than their row's default (which is what qic run passes
    when none is given) that a host program's Request has no field for: what `qic run` and `qic serve` refuse by
    name rather than drop. Rows that are no request field (qic run's `output`) are the caller's own."""
    fields = request_cls.__dataclass_fields__
    return [k for k, v in values.items() if BY_NAME[k].request and k not in fields and v != BY_NAME[k].default]


def request_class(name: str, module: str, extra: list[tuple], doc: str, only: tuple[str, ...] | None = None) -> type:
    """A host program's request dataclass: prompt, then every other request option keyword-only (so that code
    building it names each value: a new row cannot shift another's), then `extra` (the program's own fields,
    e.g. what validation resolves). `only`: the rows a program takes (None: every one); `qic run` refuses a row
    its Request lacks (qic.cli.run), so a program never silently drops one."""
    rows = [o for o in REQUEST_OPTIONS
            if o.name == "prompt" or (o.name in only if only is not None else not o.opt_in)]
    fields = [(o.name, _annotation(o), field(default=o.default, kw_only=True)) for o in rows]
    if fields[0][0] != "prompt":
        raise AssertionError("prompt must be the first request option")
    cls = make_dataclass(name, [("prompt", str), *fields[1:], *extra])
    cls.__doc__, cls.__module__ = doc, module   # pickled by name (serve hands requests to its ranks)
    return cls


def _annotation(o: RunOption):
    return o.kind | None
