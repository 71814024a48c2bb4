"""Build specs: one frozen dataclass, parsed once from YAML plus command-line overrides.

Every validation error names the key and the allowed values. Cache keys derive from these fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from qic import backends
from qic.dtypes import TORCH_DTYPES
from qic.errors import ConfigError
from qic.host.aspect import PRESETS
from qic.host.schedule import check_overrides

BACKENDS = backends.NAMES
COMPONENTS = ("text_encoder", "denoiser", "vae_decoder")
DTYPES = tuple(TORCH_DTYPES)
LAYER_MODES = ("looped", "unrolled")  # the first is the default
KEYS = ("model", "backend", "device", "tp", "dtype", "resolutions", "text_buckets", "text_bucket_step", "components",
        "output", "cache_dir", "layers", "full_hash", "scheduler", "defaults", "cfg", "loras", "compiler_args", "lnc",
        "xla_check", "cache_from", "cache_public_keys", "cache_trusted", "batch_sizes")
DEFAULT_KEYS = ("steps", "guidance")
MAX_TEXT_BUCKET = 1024 + 34  # diffusers' tokenizer limit plus the template's dropped prefix


@dataclass(frozen=True)
class BuildSpec:
    model: str | None = None                       # None: the embedded tiny checkpoint
    backend: str = backends.NAMES[0]
    device: str = "cpu"
    tp: int = 1
    dtype: tuple[tuple[str, str], ...] = tuple((c, "float32") for c in COMPONENTS)
    resolutions: tuple[tuple[int, int], ...] = ((48, 80),)   # (height, width)
    text_buckets: tuple[int, ...] = (128,)         # text-encoder lengths, template included; (0,) = exact length
    components: tuple[str, ...] = COMPONENTS
    output: str = "artifacts/tiny"
    cache_dir: str = "artifacts/cache"
    # Looped (one compiled block over stacked weights) is the default: with inductor it compiled in 0.59x
    # the time at 4 blocks (0.31x at 16, flat with depth) and ran at 0.95-0.97x the step time of
    # unrolled (docs/benchmarks.md). Components without blocks (the VAE) ignore it.
    layers: tuple[tuple[str, str], ...] = tuple((c, "looped") for c in COMPONENTS)
    full_hash: bool = False                        # hash checkpoint contents instead of trusting stat/blob ids
    # Merged over the checkpoint's scheduler_config.json (e.g. the Lightning recipe's shifts).
    scheduler: tuple[tuple[str, object], ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()  # qic run's steps / guidance when not given
    # Denoise step graphs: True = cond + uncond batched (true CFG), False = batch 1, one transformer call.
    cfg: tuple[bool, ...] = (True,)
    # Images per graph call: 1 always, and for each n > 1 batched graphs (@B<n>) that `qic serve` runs
    # compatible requests through together.
    batch_sizes: tuple[int, ...] = (1,)
    loras: tuple[tuple[str, float], ...] = ()     # (file, scale): merged into the denoiser's weights in stage 1
    # neuron back end: extra neuronx-cc flags per component, and the logical NeuronCore size (trn2: 1 or 2)
    compiler_args: tuple[tuple[str, str], ...] = ()
    lnc: int = 1
    # neuron back end: execute each lowered graph on XLA:CPU against eager PyTorch at build time. Costs a
    # forward pass per graph on the build host (minutes at the real model's size): false skips it, and
    # the manifest says the check was not run.
    xla_check: bool = True
    # A remote compile store to pull hits from (hf://ORG/REPO or a directory); its entries are used only
    # if signed by one of cache_public_keys (hex or .pub files), or if cache_trusted.
    cache_from: str | None = None
    cache_public_keys: tuple[str, ...] = ()
    cache_trusted: bool = False

    def dtype_of(self, component: str) -> str:
        return dict(self.dtype)[component]

    def layers_of(self, component: str) -> str:
        return dict(self.layers)[component]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def load_spec(config_path: str | Path | None = None, overrides: Mapping | None = None) -> BuildSpec:
    """Parse a YAML build config and apply flag overrides; with no config, BuildSpec()'s defaults (the
    embedded tiny model, as configs/tiny.yaml spells out), so the default build needs no file."""
    path = Path(config_path) if config_path else None
    raw = read_yaml_mapping(path) if path else {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "backend" in overrides and "device" not in overrides:
        raw.pop("device", None)  # the config's device belonged to its back end; use the new one's default
    # A flag for either form of text buckets replaces the config's buckets in whichever form it gave them.
    for flag, other in (("text_buckets", "text_bucket_step"), ("text_bucket_step", "text_buckets")):
        if flag in overrides and other not in overrides:
            raw.pop(other, None)
    merged = {**raw, **overrides}
    return parse_spec(merged, source=str(path) if path else "the default build")


def read_yaml_mapping(path: Path) -> dict:
    """A build config (or warm matrix) file's mapping; one clear error when absent or malformed."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys ({', '.join(KEYS)})")
    return raw


def parse_spec(raw: Mapping, source: str = "config") -> BuildSpec:
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}; allowed keys: {', '.join(KEYS)}")
    d = BuildSpec()
    backend = _choice(raw.get("backend", d.backend), BACKENDS, "backend", source)
    device = _choice(raw.get("device", backends.info(backend).DEFAULT_DEVICE), backends.all_devices(), "device",
                     source)
    if device not in backends.info(backend).DEVICES:
        targets = "; ".join(f"{n}: {' or '.join(backends.info(n).DEVICES)}" for n in BACKENDS)
        raise ConfigError(f"{source}: backend {backend!r} cannot target device {device!r} ({targets})")
    tp = raw.get("tp", d.tp)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"{source}: tp must be a positive integer, got {tp!r}")
    components = raw.get("components", list(COMPONENTS))
    if isinstance(components, str):
        components = [c.strip() for c in components.split(",")]
    for c in components:
        _choice(c, COMPONENTS, "components", source)
    return BuildSpec(
        model=raw.get("model", d.model) or None,
        backend=backend,
        device=device,
        tp=tp,
        dtype=_per_component(raw.get("dtype", "float32"), DTYPES, "dtype", source),
        resolutions=tuple(parse_resolution(r, source) for r in _as_list(raw.get("resolutions", ["48x80"]))),
        text_buckets=(buckets := _buckets(raw, source)),
        components=tuple(c for c in COMPONENTS if c in components),
        output=str(raw.get("output", d.output)),
        cache_dir=str(raw.get("cache_dir", d.cache_dir)),
        layers=_per_component(raw.get("layers", "looped"), LAYER_MODES, "layers", source),
        full_hash=bool(raw.get("full_hash", False)),
        scheduler=_scheduler(raw.get("scheduler") or {}, source),
        defaults=(defaults := _defaults(raw.get("defaults") or {}, source)),
        cfg=_cfg(raw.get("cfg"), dict(defaults), source),
        loras=_loras(raw.get("loras") or [], source),
        compiler_args=_compiler_args(raw.get("compiler_args", {}), source),
        lnc=_choice(raw.get("lnc", 1), (1, 2), "lnc", source),
        xla_check=_choice(raw.get("xla_check", True), (True, False), "xla_check", source),
        cache_from=str(raw["cache_from"]) if raw.get("cache_from") else None,
        cache_public_keys=tuple(str(k) for k in _as_list(raw.get("cache_public_keys") or [])),
        cache_trusted=bool(raw.get("cache_trusted", False)),
        batch_sizes=_batch_sizes(raw.get("batch_sizes", [1]), buckets, source),
    )


def _batch_sizes(value, buckets: tuple[int, ...], source: str) -> tuple[int, ...]:
    """A list of positive ints (or '1,2' / one int); 1 is always built (`qic run` and unmatched requests)."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else (
        value if isinstance(value, (list, tuple)) else [value])
    if not items or not all(isinstance(v, (int, str)) and not isinstance(v, bool) and str(v).isdigit()
                            and int(v) >= 1 for v in items):
        raise ConfigError(f"{source}: batch_sizes must be a list of positive integers (e.g. [1, 2]), got {value!r}")
    sizes = {int(v) for v in items}
    if max(sizes) > 1 and 0 in buckets:
        raise ConfigError(f"{source}: batch_sizes {sorted(sizes)} needs fixed text_buckets: with exact length (0) "
                          "each prompt has its own length, so prompts cannot share a batch",
                          "use text_buckets (e.g. 128) or batch_sizes [1]")
    return tuple(sorted(sizes | {1}))


def _loras(value, source: str) -> tuple[tuple[str, float], ...]:
    """A list of 'FILE[:SCALE]' strings or {file, scale} mappings."""
    out = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, Mapping):
            if "file" not in item or set(item) - {"file", "scale"}:
                raise ConfigError(f"{source}: a loras entry must be FILE[:SCALE] or {{file, scale}}, got {item!r}")
            path, scale = str(item["file"]), item.get("scale", 1.0)
        else:
            path, scale = parse_lora_arg(str(item))
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ConfigError(f"{source}: LoRA scale for {path} must be a number, got {scale!r}")
        out.append((path, float(scale)))
    return tuple(out)


def parse_lora_arg(value: str) -> tuple[str, float]:
    """'FILE[:SCALE]' -> (file, scale); a colon not followed by a number belongs to the path."""
    path, sep, tail = str(value).rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return str(value), 1.0


def _cfg(value, defaults: dict, source: str) -> tuple[bool, ...]:
    """Which step graphs to build. Default: the CFG one, plus the no-CFG one when the run defaults have no
    CFG (guidance <= 1), so both the defaults and an explicit --guidance run without a rebuild."""
    if value is None:
        return (True, False) if defaults.get("guidance", 4.0) <= 1 else (True,)
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: cfg must be true, false, or a list of them (e.g. [true, false]), got {value!r}")
    return tuple(sorted(set(values), reverse=True))


def _scheduler(value, source: str) -> tuple:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: scheduler must be a mapping of scheduler_config.json keys")
    check_overrides(value, source)
    return tuple(sorted(value.items()))


def _defaults(value, source: str) -> tuple:
    if not isinstance(value, Mapping) or set(value) - set(DEFAULT_KEYS):
        raise ConfigError(f"{source}: defaults must be a mapping with keys {', '.join(DEFAULT_KEYS)}")
    steps, guidance = value.get("steps"), value.get("guidance")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ConfigError(f"{source}: defaults.steps must be a positive integer, got {steps!r}")
    if guidance is not None and (not isinstance(guidance, (int, float)) or isinstance(guidance, bool)
                                 or not 0 <= guidance < float("inf")):
        raise ConfigError(f"{source}: defaults.guidance must be a number >= 0, got {guidance!r}")
    return tuple(sorted((k, v) for k, v in value.items() if v is not None))




def _compiler_args(value, source: str) -> tuple[tuple[str, str], ...]:
    """compiler_args: {component: "flags"} (neuron back end only)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: compiler_args must map components to flag strings, e.g. "
                          "{denoiser: '--optlevel 2'}")
    for comp, flags in value.items():
        _choice(comp, COMPONENTS, "compiler_args component", source)
        if not isinstance(flags, str):
            raise ConfigError(f"{source}: compiler_args.{comp} must be a string of flags, got {flags!r}")
    return tuple(sorted(value.items()))


def parse_resolution(value, source: str = "config") -> tuple[int, int]:
    """'HxW' (height x width) -> (h, w), or an official aspect preset such as '16:9' (width:height)."""
    if ":" in str(value):
        if str(value).strip() not in PRESETS:
            raise ConfigError(f"{source}: resolution {value!r} is not a preset; presets (width:height): "
                              + ", ".join(f"{k} = {h}x{w}" for k, (h, w) in PRESETS.items()))
        return PRESETS[str(value).strip()]
    try:
        h, w = str(value).lower().split("x")
        res = int(h), int(w)
    except ValueError:
        raise ConfigError(f"{source}: resolution {value!r} is not of the form HxW (e.g. 512x512) "
                          f"or a preset ({', '.join(PRESETS)})") from None
    if min(res) <= 0:
        raise ConfigError(f"{source}: resolution {value!r} must be positive")
    return res


def parse_buckets(value, source: str = "config") -> tuple[int, ...]:
    """Text buckets as written: a list or comma-separated lengths ('72,128'), one length ('128' or 128 is
    the one bucket 128), or 0 alone for exact length (one graph with a dynamic text dimension)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    elif not isinstance(value, (list, tuple)):
        value = [value]
    try:
        buckets = tuple(sorted({int(v) for v in value}))
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: text_buckets {value!r} must be integers (e.g. 128 or 72,128)") from None
    if not buckets or any(b < 0 for b in buckets) or (0 in buckets and len(buckets) > 1):
        raise ConfigError(f"{source}: text_buckets {value!r}: use positive lengths, or 0 alone for exact length")
    return buckets


def bucket_steps(step, source: str = "config") -> tuple[int, ...]:
    """text_bucket_step N: the buckets N, 2N, ... up to the first one that holds the longest prompt."""
    if not isinstance(step, int) or isinstance(step, bool):
        try:
            step = int(str(step).strip())
        except ValueError:
            raise ConfigError(f"{source}: text_bucket_step {step!r} must be a positive integer") from None
    if step <= 0:
        raise ConfigError(f"{source}: text_bucket_step must be a positive integer, got {step}")
    return tuple(range(step, MAX_TEXT_BUCKET + step, step))


def _buckets(raw: Mapping, source: str) -> tuple[int, ...]:
    if "text_bucket_step" in raw and "text_buckets" in raw:
        raise ConfigError(f"{source}: give text_buckets or text_bucket_step, not both")
    if "text_bucket_step" in raw:
        return bucket_steps(raw["text_bucket_step"], source)
    return parse_buckets(raw.get("text_buckets", list(BuildSpec.text_buckets)), source)


def _as_list(v):
    return [x.strip() for x in v.split(",")] if isinstance(v, str) else list(v)


def _choice(value, allowed, key, source):
    if value not in allowed:
        raise ConfigError(f"{source}: {key} {value!r} is not one of: {', '.join(allowed)}")
    return value


def _per_component(value, allowed, key, source) -> tuple[tuple[str, str], ...]:
    """One value for every component, or a mapping component -> value (others keep the default)."""
    if isinstance(value, Mapping):
        for comp in value:
            _choice(comp, COMPONENTS, f"{key} component", source)
        default = allowed[0]
        return tuple((c, _choice(value.get(c, default), allowed, f"{key}.{c}", source)) for c in COMPONENTS)
    _choice(value, allowed, key, source)
    return tuple((c, value) for c in COMPONENTS)


def with_changes(spec: BuildSpec, **changes) -> BuildSpec:
    return dataclasses.replace(spec, **changes)



