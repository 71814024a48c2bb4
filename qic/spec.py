"""Build specs: one frozen dataclass, parsed once from YAML plus command-line overrides.

Every validation error names the key and the allowed values. Cache keys derive from these fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from qic import backends, family
from qic.checkpoint.lora import lora_entry
from qic.checkpoint.presets import default_resolutions, default_text_buckets
from qic.dtypes import TORCH_DTYPES
from qic.errors import ConfigError
from qic.host.aspect import PRESETS
from qic.host.cache_policy import format_steps, settings_from
from qic.host.options import DEFAULT_KEYS, check_all
from qic.host.schedule import check_overrides

BACKENDS = backends.NAMES
DTYPES = tuple(TORCH_DTYPES)
LAYER_MODES = ("looped", "unrolled")  # the first is the default
KEYS = ("model", "backend", "device", "tp", "dtype", "resolutions", "text_buckets", "text_bucket_step", "components",
        "output", "cache_dir", "layers", "full_hash", "scheduler", "defaults", "cfg", "loras", "compiler_args", "lnc",
        "xla_check", "cache_from", "cache_public_keys", "cache_trusted", "batch_sizes", "cpu_target", "step_cache",
        "ulysses", "cfg_parallel", "condition_sizes", "condition_images", "lora_slots")
MAX_TEXT_BUCKET = 1024 + 34  # diffusers' tokenizer limit plus the template's dropped prefix


@dataclass(frozen=True)
class BuildSpec:
    model: str | None = None                       # None: the embedded default checkpoint (embedded:shapes)
    backend: str = backends.NAMES[0]
    device: str = "cpu"
    tp: int = 1
    # The model family (qic.family), picked by the model's model_index.json; the default model's by default.
    family: str = field(default_factory=lambda: family.default().name)
    # The checkpoint's pipeline class (its model_index.json `_class_name`) where it can be read without a download
    # (model_class); None for the embedded checkpoints. Read, not set: a family's graphs may differ by class
    # (Qwen-Image's Edit and Edit Plus size their vision inputs differently).
    pipeline_class: str | None = None
    # An edit model's condition-image areas in pixels, (VAE side, vision side), where the checkpoint records its own
    # (condition_areas); None: its pipeline's constants (Edit Plus: 1024*1024 and 384*384).
    condition_areas: tuple[int, int] | None = None
    # Per component, in the family's order (qic.family: its definitions are read when a spec is made).
    dtype: tuple[tuple[str, str], ...] = field(
        default_factory=lambda: tuple((c, "float32") for c in family.names(family.default())))
    # (height, width); when not given, the model's own: the trained default's three, else 48x80
    resolutions: tuple[tuple[int, int], ...] = default_resolutions(None)
    text_buckets: tuple[int, ...] = (128,)         # text-encoder lengths, template included; (0,) = exact length
                                                   # (load_spec's default where it applies: _exact_by_default)
    components: tuple[str, ...] = field(default_factory=lambda: family.names(family.default()))
    output: str = "artifacts/shapes"
    cache_dir: str = "artifacts/cache"
    # Looped (one compiled block over stacked weights) is the default: with inductor it compiled in 0.59x
    # the time at 4 blocks (0.31x at 16, flat with depth) and ran at 0.95-0.97x the step time of
    # unrolled (docs/benchmarks.md). Components without blocks (the VAE) ignore it.
    layers: tuple[tuple[str, str], ...] = field(
        default_factory=lambda: tuple((c, "looped") for c in family.names(family.default())))
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
    # inductor back end: what CPU code is compiled for (qic/backends/inductor/target.py): portable (the lowest
    # x86-64 level this host runs: x86-64-v3, AVX2 kernels), auto (the highest), a level, or native
    # (-march=native and the build host's every flag). None: portable, which cost nothing measurable against
    # native at real width (docs/benchmarks.md, "CPU targets") and serves every machine of its level.
    cpu_target: str | None = None
    # Step caching: (first, last) blocks always computed; the split step graphs are built beside the whole-step
    # ones (qic/models/qwen_image/step_cache.py). None: not built. (1, 0) is diffusers' FirstBlockCache, (8, 0)
    # cache-dit's.
    step_cache: tuple[int, int] | None = None
    # More ranks per image (qic/parallel/mesh.py): Ulysses sequence parallelism over `ulysses` ranks, and
    # CFG-parallel (the cond and uncond rows on two rank groups); world = tp x ulysses x (2 if cfg_parallel).
    ulysses: int = 1
    cfg_parallel: bool = False
    # Reference (condition) images: the sizes, VAE side, each condition image is resized to (one vision-tower and
    # one VAE-encoder graph per size: the family's condition components, qic.family.Component.conditions), and
    # how many one request may hold. () and 0: a build without them.
    condition_sizes: tuple[tuple[int, int], ...] = ()
    condition_images: int = 0
    # Per-request LoRA (qic/models/lora_slots.py): the denoiser's graphs take low-rank adapter inputs of this total
    # rank on its Linears, filled per request by the runtime; 0: none (LoRAs only merged at build, `loras`).
    lora_slots: int = 0

    @property
    def layout(self):
        from qic.parallel.mesh import Layout
        return Layout(self.tp, self.ulysses, 2 if self.cfg_parallel else 1)

    def dtype_of(self, component: str) -> str:
        return dict(self.dtype)[component]

    def layers_of(self, component: str) -> str:
        return dict(self.layers)[component]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def load_spec(config_path: str | Path | None = None, overrides: Mapping | None = None) -> BuildSpec:
    """Parse a YAML build config and apply flag overrides; with no config, BuildSpec()'s defaults (the
    embedded trained shapes model, as configs/shapes.yaml spells out), so the default build needs no file."""
    path = Path(config_path) if config_path else None
    raw = read_yaml_mapping(path) if path else {}
    lines = key_lines(raw)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "backend" in overrides and "device" not in overrides:
        raw.pop("device", None)  # the config's device belonged to its back end; use the new one's default
    # A flag for either form of text buckets replaces the config's buckets in whichever form it gave them.
    for flag, other in (("text_buckets", "text_bucket_step"), ("text_bucket_step", "text_buckets")):
        if flag in overrides and other not in overrides:
            raw.pop(other, None)
    merged = {**raw, **overrides}
    # A flag's value is named by the flag, not by the line of the file it replaced.
    lines = {k: v for k, v in lines.items() if k not in overrides}
    return parse_spec(merged, source=str(path) if path else "the default build", lines=lines)


class _Mapping(dict):
    """A config file's top-level mapping, remembering each key's line (1-based) for error messages."""
    lines: dict


def key_lines(raw: Mapping) -> dict:
    return dict(getattr(raw, "lines", {}))


def read_yaml_mapping(path: Path) -> dict:
    """A build config (or warm matrix) file's mapping; one clear error when absent, unreadable or malformed,
    with the line PyYAML reports."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})", "save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys ({', '.join(KEYS)}), got {type(raw).__name__}")
    out = _Mapping(raw)
    out.lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            out.lines.setdefault(key_node.value, key_node.start_mark.line + 1)
    return out


def parse_spec(raw: Mapping, source: str = "config", lines: Mapping | None = None) -> BuildSpec:
    """Every value checked by type: booleans take YAML booleans, lists lists (or the flags' comma form),
    numbers numbers; anything else is a ConfigError naming the key, the value and the file (and line)."""
    lines = dict(lines if lines is not None else key_lines(raw))

    def at(key: str) -> str:
        return f"{source}:{lines[key]}" if key in lines else source

    unknown = sorted(set(map(str, raw)) - set(KEYS))
    if unknown:
        raise ConfigError(f"{at(unknown[0])}: unknown key {unknown[0]!r}; allowed keys: {', '.join(KEYS)}")
    d = BuildSpec()
    backend = _choice(raw.get("backend", d.backend), BACKENDS, "backend", at("backend"))
    device = _choice(raw.get("device", backends.info(backend).DEFAULT_DEVICE), backends.all_devices(), "device",
                     at("device"))
    if device not in backends.info(backend).DEVICES:
        targets = "; ".join(f"{n}: {' or '.join(backends.info(n).DEVICES)}" for n in BACKENDS)
        raise ConfigError(f"{at('device')}: backend {backend!r} cannot target device {device!r} ({targets})")
    tp = _positive_int(raw.get("tp", d.tp), "tp", at("tp"))
    ulysses = _positive_int(raw.get("ulysses", d.ulysses), "ulysses", at("ulysses"))
    cfg_parallel = _bool(raw.get("cfg_parallel", d.cfg_parallel), "cfg_parallel", at("cfg_parallel"))
    model = _optional_str(raw.get("model", d.model), "model", at("model"))
    fam = model_family(model)
    if fam.backends is not None and backend not in fam.backends:   # the family record's own list (qic.family)
        raise ConfigError(f"{at('backend')}: the {fam.name} family's graphs are made for the "
                          f"{' and '.join(fam.backends)} back end{'s' if len(fam.backends) > 1 else ''}, not {backend} "
                          "(not yet)", f"build with --backend {fam.backends[0]}")
    known = family.names(fam)
    index = _model_index(model)   # read once: the pipeline class and the condition areas are both its keys
    pipeline_class = (index or {}).get("_class_name")
    condition_sizes, condition_images = _conditions(
        raw, at, embedded_condition_defaults(model) or fam.condition_defaults.get(pipeline_class))
    components = _components(raw, fam, bool(condition_sizes), at)
    resolutions = default_resolutions(model)
    spec = BuildSpec(
        model=model,
        family=fam.name,
        pipeline_class=pipeline_class,
        condition_areas=_condition_areas(model, index),
        backend=backend,
        device=device,
        tp=tp,
        dtype=_per_component(raw.get("dtype", _default_dtype(fam, backend, device, raw.get("cpu_target"), known,
                                                             condition_sizes)), DTYPES, "dtype", at("dtype"), known),
        resolutions=tuple(parse_resolution(r, at("resolutions")) for r in _str_list(
            raw.get("resolutions", [f"{h}x{w}" for h, w in resolutions]), "resolutions", at("resolutions"))),
        text_buckets=(buckets := _buckets(raw, at, model, _exact_by_default(
            fam, backend, device, condition_sizes, tp > 1 or ulysses > 1 or cfg_parallel, raw.get("batch_sizes")))),
        components=tuple(c for c in known if c in components),
        output=_path(raw.get("output", d.output), "output", at("output")),
        cache_dir=_path(raw.get("cache_dir", d.cache_dir), "cache_dir", at("cache_dir")),
        layers=_per_component(raw.get("layers", "looped"), LAYER_MODES, "layers", at("layers"), known),
        full_hash=_bool(raw.get("full_hash", d.full_hash), "full_hash", at("full_hash")),
        scheduler=_scheduler(_mapping(raw.get("scheduler"), "scheduler", at("scheduler")), at("scheduler")),
        defaults=(defaults := _defaults(_mapping(raw.get("defaults"), "defaults", at("defaults")), at("defaults"))),
        cfg=_cfg(raw.get("cfg"), dict(defaults), at("cfg")),
        loras=_loras(raw.get("loras") or [], at("loras")),
        compiler_args=_compiler_args(_mapping(raw.get("compiler_args"), "compiler_args", at("compiler_args")),
                                     at("compiler_args"), known),
        lnc=_choice(_positive_int(raw.get("lnc", d.lnc), "lnc", at("lnc")), (1, 2), "lnc", at("lnc")),
        xla_check=_bool(raw.get("xla_check", d.xla_check), "xla_check", at("xla_check")),
        cache_from=_optional_str(raw.get("cache_from"), "cache_from", at("cache_from")),
        cache_public_keys=tuple(_str_list(raw.get("cache_public_keys") or [], "cache_public_keys",
                                          at("cache_public_keys"))),
        cache_trusted=_bool(raw.get("cache_trusted", d.cache_trusted), "cache_trusted", at("cache_trusted")),
        batch_sizes=_batch_sizes(raw.get("batch_sizes", [1]), buckets, at("batch_sizes")),
        cpu_target=_cpu_target(raw.get("cpu_target"), backend, at("cpu_target")),
        step_cache=_step_cache(raw.get("step_cache"), components, at("step_cache")),
        ulysses=ulysses,
        cfg_parallel=cfg_parallel,
        condition_sizes=condition_sizes,
        condition_images=condition_images,
        lora_slots=_lora_slots(raw.get("lora_slots", 0), components, backend, at("lora_slots")),
    )
    if 0 in spec.text_buckets and not _dynamic_text(backend):
        raise ConfigError(f"{at('text_buckets')}: exact-length text (0) needs graphs with a dynamic text length; the "
                          f"{backend} back end's have static shapes", "use fixed text buckets, e.g. 128,256")
    _cache_defaults_need_graphs(dict(spec.defaults), spec.step_cache, at("defaults"))
    if spec.lora_slots and spec.step_cache and any(n > 1 for n in spec.batch_sizes):
        raise ConfigError(f"{at('lora_slots')}: lora_slots with step_cache and batch sizes above 1: not yet (a batch's "
                          "one-row middle graph cannot tell whose adapters its row takes)",
                          "drop --batch-sizes, or merge the LoRA at build time (--lora FILE[:SCALE])")
    _layout_combinations(spec, at)
    return spec


def _conditions(raw: Mapping, at, defaults=None) -> tuple[tuple[tuple[int, int], ...], int]:
    """(condition sizes, condition images): sizes as resolutions are written, in the order given, each once; the
    image count 1 when sizes are given without it, and no count without sizes (nothing to run them on). `defaults`:
    the checkpoint's pipeline class's (sizes, count) when it reads condition images (qic.family.Family
    .condition_defaults), what a build without the keys gets."""
    sizes = tuple(dict.fromkeys(parse_resolution(r, at("condition_sizes")) for r in _str_list(
        raw.get("condition_sizes") or [], "condition_sizes", at("condition_sizes"))))
    if defaults and not sizes:
        sizes = tuple(defaults[0])
    count = raw.get("condition_images")
    if count is None:
        return sizes, (defaults[1] if defaults else 1) if sizes else 0
    count = _positive_int(count, "condition_images", at("condition_images"))
    if not sizes:
        raise ConfigError(f"{at('condition_images')}: condition_images {count} needs condition_sizes (the sizes "
                          "condition images are resized to)", "add --condition-size HxW, or drop --condition-images")
    return sizes, count


def _components(raw: Mapping, fam, conditions: bool, at) -> list[str]:
    """The components asked for (default: every one of the family's, its condition components only when the build
    names condition sizes); a condition component named without them is refused, and so are condition sizes for a
    family with no component to encode them."""
    defs = family.components(fam)
    source = at("components")
    if conditions and not any(c.conditions for c in defs.values()):
        raise ConfigError(f"{at('condition_sizes')}: the {fam.name} family's graphs take no condition images (not "
                          "yet)", "drop --condition-size / condition_sizes")
    default = [n for n, c in defs.items() if conditions or not c.conditions]
    components = _str_list(raw.get("components", default), "components", source)
    for c in components:
        _choice(c, tuple(defs), "components", source)
        if defs[c].conditions and not conditions and not defs[c].opt_in:
            raise ConfigError(f"{source}: component {c} encodes condition images, but the build names no "
                              "condition_sizes", "add --condition-size HxW, or leave it out of components")
    return components


def _layout_combinations(spec: BuildSpec, at) -> None:
    """What the parallel layouts do not combine with, refused in one line naming it."""
    if spec.layout.plain:
        return
    key = "ulysses" if spec.ulysses > 1 else "cfg_parallel"
    if "denoiser" not in spec.components:
        raise ConfigError(f"{at(key)}: {key} splits the denoiser, but components leave the denoiser out")
    if spec.ulysses > 1 and 0 in spec.text_buckets:
        raise ConfigError(f"{at('ulysses')}: ulysses with exact-length text (text bucket 0) is not supported: "
                          "Ulysses pads the text to a multiple of U, which one graph over a dynamic length cannot "
                          "express", "use fixed text buckets (e.g. 128,256) with ulysses")
    if spec.cfg_parallel and True not in spec.cfg:
        raise ConfigError(f"{at('cfg_parallel')}: cfg_parallel splits the true-CFG step, but cfg builds only the "
                          "no-CFG graph", "add true to cfg, or drop cfg_parallel")


def _cpu_target(value, backend: str, source: str) -> str | None:
    if value is None:
        return None
    allowed = backends.info(backend).OPTIONS.get("cpu_target")
    if allowed is None:
        takers = [n for n in BACKENDS if "cpu_target" in backends.info(n).OPTIONS]
        raise ConfigError(f"{source}: cpu_target is an option of the {', '.join(takers)} back end, not of {backend}",
                          "remove cpu_target, or build with that back end")
    return _choice(value, allowed, "cpu_target", source)


def _bool(value, key: str, source: str) -> bool:
    """YAML's true/false only: bool("false") is True, so a string here would turn a check off silently."""
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}",
                          f"write {key}: true or {key}: false, unquoted")
    return value


def _positive_int(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _path(value, key: str, source: str) -> str:
    """A directory: a non-empty string (null would become a directory named 'None')."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: {key} must be a directory path (a non-empty string), got {value!r}")
    return value


def _optional_str(value, key: str, source: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
    return value


def _mapping(value, key: str, source: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: {key} must be a mapping, got {value!r}")
    return value


def _str_list(value, key: str, source: str) -> list[str]:
    """A list of strings, or the flags' comma-separated form ('a,b'); a bare number is not a list."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: {key} must be a list of strings (e.g. [a, b]), got {value!r}")
    return list(value)


def _batch_sizes(value, buckets: tuple[int, ...], source: str) -> tuple[int, ...]:
    """A list of positive ints (or '1,2' / one int); 1 is always built (`qic run` and unmatched requests)."""
    items = _int_list(value)
    if not items or not all(v >= 1 for v in items):
        raise ConfigError(f"{source}: batch_sizes must be a list of positive integers (e.g. [1, 2]), got {value!r}")
    sizes = {int(v) for v in items}
    if max(sizes) > 1 and 0 in buckets:
        raise ConfigError(f"{source}: batch_sizes {sorted(sizes)} needs fixed text_buckets: with exact length (0) "
                          "each prompt has its own length, so prompts cannot share a batch",
                          "use text_buckets (e.g. 128) or batch_sizes [1]")
    return tuple(sorted(sizes | {1}))


def _loras(value, source: str) -> tuple[tuple[str, float], ...]:
    """A list of 'FILE[:SCALE]' strings or {file, scale} mappings."""
    if not isinstance(value, (list, tuple, str, Mapping)):
        raise ConfigError(f"{source}: loras must be a list of FILE[:SCALE] or {{file, scale}}, got {value!r}")
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(lora_entry(item, "file", source, "loras entry") for item in items)


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
    check_overrides(value, source)
    return tuple(sorted(value.items()))


def _defaults(value, source: str) -> tuple:
    """Run defaults a bundle records (qic run's and qic serve's when a request leaves them out): the run options
    whose rows say a bundle may set them, each checked by its row."""
    if not isinstance(value, Mapping) or set(value) - set(DEFAULT_KEYS):
        raise ConfigError(f"{source}: defaults must be a mapping with keys {', '.join(DEFAULT_KEYS)}")
    check_all({k: v for k, v in value.items() if k != "cache_steps"}, f"{source}: defaults")
    cache = settings_from({k: v for k, v in value.items() if k.startswith("cache_")}, f"{source}: defaults")
    value = dict(value)
    if cache.steps is not None:
        value["cache_steps"] = format_steps(cache.steps)   # one hashable form: '0-7,9'
    return tuple(sorted((k, v) for k, v in value.items() if v is not None))


def _compiler_args(value, source: str, known) -> tuple[tuple[str, str], ...]:
    """compiler_args: {component: "flags"} (neuron back end only)."""
    for comp, flags in value.items():
        _choice(comp, known, "compiler_args component", source)
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
    items = _int_list(value)
    if items is None:
        raise ConfigError(f"{source}: text_buckets {value!r} must be integers (e.g. 128 or 72,128)")
    buckets = tuple(sorted(set(items)))
    if not buckets or any(b < 0 for b in buckets) or (0 in buckets and len(buckets) > 1):
        raise ConfigError(f"{source}: text_buckets {value!r}: use positive lengths, or 0 alone for exact length")
    if max(buckets) > MAX_TEXT_BUCKET:
        raise ConfigError(f"{source}: text_buckets {value!r}: the longest prompt the tokenizer gives is "
                          f"{MAX_TEXT_BUCKET} tokens; a longer bucket is never used")
    return buckets


def bucket_steps(step, source: str = "config") -> tuple[int, ...]:
    """text_bucket_step N: the buckets N, 2N, ... up to the first one that holds the longest prompt."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise ConfigError(f"{source}: text_bucket_step {step!r} must be a positive integer")
    if step <= 0:
        raise ConfigError(f"{source}: text_bucket_step must be a positive integer, got {step}")
    return tuple(range(step, MAX_TEXT_BUCKET + step, step))


def _buckets(raw: Mapping, at, model: str | None = None, exact: bool = False) -> tuple[int, ...]:
    """The build's text buckets: as given, else exact length (0) where `exact`, else the model's default."""
    if "text_bucket_step" in raw and "text_buckets" in raw:
        raise ConfigError(f"{at('text_bucket_step')}: give text_buckets or text_bucket_step, not both")
    if "text_bucket_step" in raw:
        return bucket_steps(raw["text_bucket_step"], at("text_bucket_step"))
    default = (0,) if exact else default_text_buckets(model)
    return parse_buckets(raw.get("text_buckets", list(default)), at("text_buckets"))


def _default_dtype(fam, backend: str, device: str, cpu_target, known, condition_sizes) -> str | dict:
    """A build without dtype: bf16 text encoder and denoiser where the back end says the build's CPU code runs on
    bf16 units (the inductor back end's bf16_units: --cpu-target native on such a CPU) and the family's bf16
    text-to-image images are checked against the reference's bf16 (Family.bf16_default; Qwen-Image's:
    tests/test_bf16_fidelity.py, at exact-length text as such a build gets it); float32 everywhere else, condition
    images' builds included. The VAE stays float32."""
    units = getattr(backends.info(backend), "bf16_units", None)
    if units is None or not fam.bf16_default or condition_sizes or not units(device, cpu_target):
        return "float32"   # a bad cpu_target reads as none of these, and is refused where it is read
    return {c: "bfloat16" for c in ("text_encoder", "denoiser") if c in known}


def _dynamic_text(backend: str) -> bool:
    """Whether the back end's graphs may take a dynamic text length (its DYNAMIC_TEXT)."""
    return getattr(backends.info(backend), "DYNAMIC_TEXT", False)


def _exact_by_default(fam, backend: str, device: str, condition_sizes, several_ranks: bool, batch_sizes) -> bool:
    """Whether a build that names no text buckets gets exact-length text (one graph per resolution for every prompt
    length, no padded rows): where the family's graphs and the back end take a dynamic text length, and nothing
    else in the build needs fixed ones (Ulysses pads the text to a multiple of U, a batch shares one length, the
    edit graphs' text rows are fixed) or has not run with a dynamic one (graphs with collectives: TP and
    CFG-parallel; CUDA). Elsewhere the fixed default (one bucket of 128, an embedded edit preset's own) holds."""
    # batch_sizes as given (they are checked against the buckets after): only whether any is above 1 matters here
    fixed_needed = (condition_sizes or device != "cpu" or several_ranks
                    or any(n != 1 for n in _int_list(batch_sizes if batch_sizes is not None else [1]) or [1]))
    return bool(fam.exact_text and _dynamic_text(backend) and not fixed_needed)


def _cache_defaults_need_graphs(defaults: dict, step_cache, source: str) -> None:
    active = (defaults.get("cache_threshold") or 0) > 0 or defaults.get("cache_steps") is not None
    if active and step_cache is None:
        raise ConfigError(f"{source}: defaults turn step caching on, but the build has no step_cache",
                          "add step_cache: {first: 1, last: 0} (or --step-cache 1,0)")


def _lora_slots(value, components, backend: str, source: str) -> int:
    """lora_slots: a rank >= 0 (0: none), on what the slotted graphs are written for."""
    if value in (0, None):
        return 0
    rank = _positive_int(value, "lora_slots", source)
    if "denoiser" not in components:
        raise ConfigError(f"{source}: lora_slots puts adapter inputs in the denoiser's graphs, but components leave "
                          "the denoiser out")
    if not getattr(backends.info(backend), "REBINDS_WEIGHTS", False):
        raise ConfigError(f"{source}: lora_slots on the {backend} back end: not yet (its runtime binds weights once)",
                          "merge the LoRA at build time (--lora FILE[:SCALE]), or build for inductor")
    return rank


def _step_cache(value, components, source: str) -> tuple[int, int] | None:
    """{first: Fn, last: Bn}, [Fn, Bn] or the flag's 'Fn,Bn'; Fn >= 1 (the decision needs a block's residual),
    Bn >= 0. Whether the denoiser has a middle left is checked against its config when the graphs are planned."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - {"first", "last"})
        if unknown:
            raise ConfigError(f"{source}: step_cache has keys first and last, got {unknown[0]!r}")
        value = [value.get("first", 1), value.get("last", 0)]
    items = _int_list(value)
    if not items or len(items) != 2 or items[0] < 1 or items[1] < 0:
        raise ConfigError(f"{source}: step_cache must be {{first: Fn, last: Bn}} (or 'Fn,Bn') with Fn >= 1 and "
                          f"Bn >= 0, e.g. 1,0 (diffusers' FirstBlockCache) or 8,0 (cache-dit's), got {value!r}")
    if "denoiser" not in components:
        raise ConfigError(f"{source}: step_cache splits the denoiser's step, but components leave the denoiser out")
    return items[0], items[1]


def _int_list(value) -> list[int] | None:
    """Integers as a list, one integer, or the flags' comma form ('72,128'); None if anything is not an
    integer (72.5 is refused rather than read as 72, True rather than read as 1)."""
    if isinstance(value, str):
        parts = [v.strip() for v in value.split(",") if v.strip()]
        if not all(v.isdigit() for v in parts):
            return None
        return [int(v) for v in parts]
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return None
    return list(items)


def _choice(value, allowed, key, source):
    # type(v) == type(value): True == 1 and 1.0 == 1, but neither is the lnc 1.
    if isinstance(value, (list, dict)) or not any(value == v and type(v) is type(value) for v in allowed):
        raise ConfigError(f"{source}: {key} {value!r} is not one of: {', '.join(map(str, allowed))}")
    return value


def _per_component(value, allowed, key, source, known) -> tuple[tuple[str, str], ...]:
    """One value for every component, or a mapping component -> value (others keep the default)."""
    if isinstance(value, Mapping):
        for comp in value:
            _choice(comp, known, f"{key} component", source)
        default = allowed[0]
        return tuple((c, _choice(value.get(c, default), allowed, f"{key}.{c}", source)) for c in known)
    _choice(value, allowed, key, source)
    return tuple((c, value) for c in known)


def model_family(model: str | None) -> family.Family:
    """The family of the model a spec names, by its model_index.json where that can be read without a download:
    an embedded model (the embedded checkpoints' class), a local directory's file, a hub id's file in the local
    hub cache. Otherwise (a directory without one, a hub repo not fetched yet) the default family: the checkpoint
    reader reports a missing directory or file when the build resolves it, and the build checks that the fetched
    checkpoint is of the family its spec was checked for (qic.builder.context)."""
    from qic.checkpoint.model_index import local_model_index

    index = local_model_index(model)
    return family.of_model_index(index) if index is not None else family.default()


def _model_index(model: str | None) -> dict | None:
    """A model's model_index.json where model_family can read it: an embedded preset's as its writer writes it."""
    import json

    from qic.checkpoint.model_index import EMBEDDED_PREFIX, local_model_index

    if model is not None and model.startswith(EMBEDDED_PREFIX):
        from qic.checkpoint import embedded, presets
        name = model.removeprefix(EMBEDDED_PREFIX)
        return embedded.model_index(presets.PRESETS[name]) if name in presets.PRESETS else None
    index = local_model_index(model)
    try:
        data = json.loads(index.read_text()) if index is not None else None
    except (OSError, ValueError):
        return None   # model_family has already refused an unreadable file, naming it
    return data if isinstance(data, dict) else None


def model_class(model: str | None) -> str | None:
    """The pipeline class a model's model_index.json names, where model_family can read it; None otherwise."""
    return (_model_index(model) or {}).get("_class_name")


def condition_areas(model: str | None) -> tuple[int, int] | None:
    """(VAE side, vision side) pixel areas an edit model records as its own (qic.checkpoint.embedded
    .CONDITION_AREAS_KEY: the trained shapes-edit model's pictures keep their 128*128 pixels); None for the
    pipeline's own. A malformed record is refused naming the key."""
    return _condition_areas(model, _model_index(model))


def _condition_areas(model: str | None, index: dict | None) -> tuple[int, int] | None:
    from qic.checkpoint.embedded import CONDITION_AREAS_KEY

    areas = (index or {}).get(CONDITION_AREAS_KEY)
    if areas is None:
        return None
    try:
        vae, vision = int(areas["vae"]), int(areas["vision"])
    except (TypeError, KeyError, ValueError):
        vae = vision = 0
    if vae <= 0 or vision <= 0:
        raise ConfigError(f"{model}: model_index.json's {CONDITION_AREAS_KEY} must be {{\"vae\": PIXELS, "
                          f"\"vision\": PIXELS}}, positive integers; it is {areas!r}")
    return vae, vision


def embedded_condition_defaults(model: str | None):
    """An embedded edit model's (condition sizes, images) when the build names none: the resolutions it was
    trained at, one image (what it was trained with); None for any other model."""
    from qic.checkpoint.model_index import EMBEDDED_PREFIX
    from qic.checkpoint.presets import PRESETS

    if model is None or not model.startswith(EMBEDDED_PREFIX):
        return None
    p = PRESETS.get(model.removeprefix(EMBEDDED_PREFIX), {})
    return (tuple(tuple(r) for r in p["default_resolutions"]), 1) if p.get("edit") else None


def with_changes(spec: BuildSpec, **changes) -> BuildSpec:
    return dataclasses.replace(spec, **changes)



