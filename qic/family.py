"""Model families and their components, each declared once (issue 30's family seam).

A model family is one folder: a package with a `family.py` whose `FAMILY` is a `Family` record, found by
`registry()` wherever it lives: every `qic/models/<name>/family.py` (Qwen-Image's: qic/models/qwen_image/), and
any package installed outside qic that names its record under the `qic.families` entry point group. The record
says which model_index.json `_class_name`s the family reads, where its component definitions are (its
`components` module, build time: `COMPONENTS` plus the optional hooks `validate(spec, ctx)` and
`manifest_fields(spec, ctx)`) and which host program runs its bundles (`host`, recorded in the manifest; the
runtime imports it by that name: qic.runtime.programs). `family.py` imports nothing but this module, so the
runtime and the spec's checks read records without any torch model code.

A component (`Component`) is what a build compiles: where its checkpoint keeps it, how its eager module is made
and its weights converted, which graphs a build asks of it and how each is made, what its graphs' keys depend
on, its dtype rule, its tensor-parallel plan and its neuronx-cc model type. The build stages (planning,
sharding, binding, the eager stand-in, qic plan), the spec's checks, the TP plans and the neuron back end look a
component up by name in the family being built (`use`), so a new component is one definition and a new family
one folder. A family's components module is loaded by name, not by an import statement: its definitions use
the builder's graph code, while the layers below the builder ask it for components, and a static import from
them would make the package layering circular. qic.builder.jobs keys graphs by that module's code too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from qic.errors import ConfigError

EMBEDDED_CLASS = "QwenImagePipeline"   # the class every embedded checkpoint's model_index.json names
ENTRY_POINTS = "qic.families"   # the entry point group of families installed outside qic (value: module:FAMILY)
_MODELS = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class Family:
    name: str                     # e.g. "qwen-image": the manifest's family, error lines
    classes: tuple[str, ...]      # the model_index.json `_class_name`s it reads
    components: str               # the module holding its COMPONENTS (build time)
    host: str                     # the module of its host program (run time: qic.runtime.programs)
    # The host program of its builds with condition sizes, when they need another (Qwen-Image's editing); None: `host`
    conditions_host: str | None = None
    # Per pipeline class that reads condition images: (default condition sizes, default --condition-images), what a
    # build of such a checkpoint gets without --condition-size / --condition-images (qic.spec)
    condition_defaults: Mapping[str, tuple[tuple[tuple[int, int], ...], int]] = field(default_factory=dict)
    tokenizer: str = "tokenizer"  # the checkpoint folder holding its tokenizer files (Qwen-Image-2.1: processor)
    # The back ends its graphs are made for (qic.backends' names; None: every one). Checked by the build before any
    # work (qic.spec, when the build config is read), so no family code asks which back end it is built for.
    backends: tuple[str, ...] | None = None
    # Its text-to-image graphs take a dynamic text length (text bucket 0): what a build without text buckets gets
    # where the back end and the rest of the build allow it (qic.spec._exact_by_default); else its fixed default.
    exact_text: bool = False
    # Its text-to-image images in bf16 are checked against the reference's bf16: a build without dtype for a CPU with
    # bf16 units runs its text encoder and denoiser in bf16 (qic.spec._default_dtype)
    bf16_default: bool = False

    def host_of(self, spec) -> str:
        """The host program a build of `spec` records in its manifest."""
        return self.conditions_host if spec.condition_sizes and self.conditions_host else self.host

    @property
    def package(self) -> str:
        """The family's folder, as a package (where its components module is)."""
        return self.components.rpartition(".")[0]


COLUMN, ROW = 0, 1  # a TP plan's split dim: by output rows (column-parallel) or input columns (row-parallel)


@dataclass(frozen=True)
class TPPlan:
    """Which of a component's weights split across TP ranks (qic.parallel.plans applies it). Empty: the component
    is replicated, sharded and compiled once whatever the build's TP.
    rules: (tensor-name regex, split dim), first match wins; unmatched tensors stay whole.
    rank_tensors: per-rank tensors no checkpoint holds, name -> (the split tensor, its dim): the rank's first
      index along it, written into every rank's shard at TP > 1 (a vocab-parallel embedding's first row).
    padded: split tensors whose dim need not divide by TP (a vocabulary); ranks get ceil(n / tp) rows."""
    rules: tuple[tuple[str, int], ...] = ()
    rank_tensors: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    padded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Component:
    name: str                     # qic's name, e.g. denoiser: graph names, spec keys, shard folders
    folder: str                   # the checkpoint folder holding its config and weights
    parse_config: Callable[[Mapping], object]
    make_module: Callable[..., object]   # (config, tp_size=1, looped=False) -> module with the checkpoint's names
    convert: Callable[[Mapping], dict]   # per-tensor: {ckpt name: t} -> {module name: t'}
    sources: tuple[str, ...]      # modules whose code decides the converted weights (their bytes key its shards)
    graph_shapes: Callable[[object], list[dict]]   # (BuildSpec) -> the shape of every graph it asks for, in order
    # (module, configs by component, shape, run dtype, Layout) -> GraphDef: qic.builder.graphs.make_graph calls it
    # for every build stage, and the eager stand-in (qic.builder.eager) for its graphs
    make_graph: Callable[..., object]
    config_deps: tuple[str, ...]  # checkpoint folders whose configs its graphs depend on (spec keys)
    tp_plan: TPPlan = TPPlan()
    fixed_dtype: str | None = None  # a component that always runs in this dtype, whatever the build's
    # The module name of its layer list when it has a looped form over stacked block weights (qic.models.looped:
    # the shard stage stacks `<blocks>.<i>.*` into `<blocks>.stacked.*`); None: it has none.
    blocks: str | None = None
    # Its graphs run the parallel layout's Ulysses / CFG-parallel ranks (the others are replicated across them),
    # so the layout keys them even at TP 1, and the eager stand-in gives it the layout's TP shard.
    runs_layout: bool = False
    lora_target: bool = False       # LoRAs (qic build --lora) merge into its weights
    # The Linears a build's LoRA slots cover (--lora-slots: qic.models.lora_slots), a regex over their checkpoint
    # module names; a lora_target only.
    lora_modules: str = ".*"
    # It encodes condition (reference) images (a vision tower, a VAE encoder): a build holds it only when it names
    # condition sizes (BuildSpec.condition_sizes), one graph per size.
    conditions: bool = False
    # A condition component a build without condition sizes may still name in its components (it then makes graphs
    # of its own kind: Qwen-Image's VAE encoder for img2img at the output resolutions); never in the default list.
    opt_in: bool = False
    neuron_model_type: str = "generic"   # neuronx-cc --model-type (qic.backends.neuron.cc)

    @property
    def stackable(self) -> bool:
        return self.blocks is not None

    def run_dtype(self, build_dtype: str) -> str:
        """The dtype its weights and graphs have in a build that asks for `build_dtype` (the spec's per component)."""
        return self.fixed_dtype or build_dtype

    def tp_degree(self, tp: int) -> int:
        """The TP degree its shards and graphs are made for: 1 for a replicated component (empty plan)."""
        return tp if self.tp_plan.rules else 1


def _folders() -> list[str]:
    """The family folders under qic/models: packages with a family.py."""
    return [m.name for m in pkgutil.iter_modules([str(_MODELS)])
            if m.ispkg and (_MODELS / m.name / "family.py").is_file()]


def packages() -> list[str]:
    """The packages of every known family, found without importing any of them (what the runtime may import a
    host program from: qic.runtime.programs)."""
    from importlib.metadata import entry_points

    return [f"qic.models.{name}" for name in _folders()] + \
        [ep.value.partition(":")[0].rpartition(".")[0] for ep in entry_points(group=ENTRY_POINTS)]


def registry() -> dict[str, Family]:
    """Every known family by name: the folders under qic/models with a family.py, then the entry points'."""
    from importlib.metadata import entry_points

    found = [importlib.import_module(f"qic.models.{name}.family").FAMILY for name in _folders()]
    found += [ep.load() for ep in entry_points(group=ENTRY_POINTS)]
    out: dict[str, Family] = {}
    for fam in found:
        clash = [c for other in out.values() for c in fam.classes if c in other.classes]
        if fam.name in out or clash:
            raise ConfigError(f"two model families claim {fam.name if fam.name in out else clash[0]!r}")
        out[fam.name] = fam
    return out


@functools.cache
def _registry() -> dict[str, Family]:
    return registry()


def known_classes() -> list[str]:
    return sorted(c for fam in _registry().values() for c in fam.classes)


def by_name(name: str) -> Family:
    found = _registry().get(name)
    if found is None:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(sorted(_registry()))}")
    return found


def for_class(class_name, where: str) -> Family:
    """The family reading pipeline class `class_name` (a model_index.json's `_class_name`, read from `where`);
    any other is one ConfigError line naming the file, the class and the known classes."""
    for fam in _registry().values():
        if class_name in fam.classes:
            return fam
    raise ConfigError(f"{where}: _class_name {class_name!r} is no model family qic knows "
                      f"(known: {', '.join(known_classes())})")


def of_model_index(path: Path) -> Family:
    """The family of a checkpoint, by its model_index.json."""
    try:
        index = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({type(e).__name__})") from None
    return for_class(index.get("_class_name") if isinstance(index, dict) else None, str(path))


def default() -> Family:
    """The family of the embedded checkpoints (qic build's default model)."""
    return for_class(EMBEDDED_CLASS, "the embedded checkpoints")


_current: list[Family] = []   # the family being built (use); empty: default()


def use(fam: Family | str) -> Family:
    """Make `fam` (a record or a name) the family whose components the build stages look up."""
    fam = by_name(fam) if isinstance(fam, str) else fam
    _current[:] = [fam]
    return fam


def current() -> Family:
    return _current[0] if _current else default()


@contextlib.contextmanager
def using(fam: Family | str):
    """use(fam) for the block: the family in use before it is in use again after it (an eager stand-in of one family
    leaves none of its own in use)."""
    saved = list(_current)
    try:
        yield use(fam)
    finally:
        _current[:] = saved


def components_module(fam: Family | str | None = None):
    """A family's components module (the family being built when none is named): COMPONENTS and its optional
    build hooks (validate, manifest_fields)."""
    fam = current() if fam is None else by_name(fam) if isinstance(fam, str) else fam
    return importlib.import_module(fam.components)


def components(fam: Family | str | None = None) -> dict[str, Component]:
    """A family's components by name, in build order (the family being built when none is named)."""
    return components_module(fam).COMPONENTS


def names(fam: Family | str | None = None) -> tuple[str, ...]:
    return tuple(components(fam))


def component(name: str) -> Component:
    """The definition of `name` in the family being built; an unknown name is one ConfigError line listing the
    known ones."""
    found = components().get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"unknown component {name!r}; known: {', '.join(names())}")
    return found


def folders(fam: Family | str | None = None) -> tuple[str, ...]:
    """The checkpoint folders the components are compiled from, in component order."""
    return tuple(c.folder for c in components(fam).values())
