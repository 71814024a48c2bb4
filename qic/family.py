"""What a compiled component is, declared once: the one definition every stage reads (issue 30's family seam).

A model family (Qwen-Image today: qic/models/qwen_image/components.py) is a module whose `COMPONENTS` maps each
component's name to a `Component`: where its checkpoint keeps it, how its eager module is made and its
weights converted, which graphs a build asks of it and how each is made, what its graphs' keys depend on,
its dtype rule, its tensor-parallel plan and its neuronx-cc model type. The build stages (planning, sharding,
binding, the eager stand-in, qic plan), the spec's checks, the TP plans and the neuron back end all look a
component up here by name, so a new component is one definition.

The family module is loaded by name, not by an import statement: its definitions use the builder's graph
code, while the spec, the checkpoint reader, the TP plans and the back ends below the builder ask it for
components, and a static import from them would make the package layering circular. It is the same move the
family pick by `model_index.json` will make. qic.builder.jobs keys graphs by the family module's code too
(CODE_ROOTS), since no import statement leads the code walk to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qic.errors import ConfigError

FAMILY = "qic.models.qwen_image.components"   # the module holding the family's COMPONENTS

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
    sources: tuple[str, ...]      # files under qic/models whose code decides the converted weights (shard keys)
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


def components() -> dict[str, Component]:
    """The family's components by name, in build order."""
    return importlib.import_module(FAMILY).COMPONENTS


def names() -> tuple[str, ...]:
    return tuple(components())


def component(name: str) -> Component:
    """The definition of `name`; an unknown name is one ConfigError line listing the known ones."""
    found = components().get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"unknown component {name!r}; known: {', '.join(names())}")
    return found


def folders() -> tuple[str, ...]:
    """The checkpoint folders the components are compiled from, in component order."""
    return tuple(c.folder for c in components().values())
