"""What a graph is to the build stages (GraphDef) and the one call that makes any component's graph
(make_graph, by the component's own maker). A family's graph makers live in its folder (Qwen-Image's:
qic/models/qwen_image/graphs.py); nothing here knows a component or a family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from qic import family
from qic.parallel.mesh import AXES, Layout

PLAIN = Layout()


@dataclass
class GraphDef:
    name: str                      # e.g. "denoiser@48x80@L128"
    component: str
    module: nn.Module              # weights bound (memory-mapped) before export
    inputs: list[tuple[str, torch.Tensor]]
    outputs: list[str]
    dynamic: dict | None = None    # torch.export dynamic_shapes, for exact-length text
    weight_prefix: str = ""        # graph constant name = prefix + weight-shard tensor name
    shape: dict = field(default_factory=dict)  # what the runtime selects on: resolution, bucket
    # A parallel layout's collective groups: name -> replica groups over the world (None: plain TP's world group)
    groups: dict | None = None
    # () -> [(input name, tensor)] in `inputs`' order: values a back end's check of the compiled graph feeds it,
    # for a graph whose inputs must be consistent with each other (positions, masks, RoPE tables) to mean
    # anything; None: the check draws them from the example inputs (qic.backends.neuron.build.check_inputs).
    sample: Callable[[], list[tuple[str, torch.Tensor]]] | None = None


def make_graph(component: str, module, configs: dict, shape: dict, dtype: str, layout: Layout = PLAIN):
    """The GraphDef of one graph around a component module (weights bound, or fake for estimates), by the
    shape its definition plans (qic.family.Component.graph_shapes), made by its definition's graph maker.
    `dtype`: the component's run dtype (Component.run_dtype)."""
    gdef = family.component(component).make_graph(module, configs, shape, dtype, layout)
    if not layout.plain:
        gdef.groups = {layout.group_name(a): layout.groups(a) for a in AXES}
    return gdef
