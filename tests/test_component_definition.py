"""A component is one definition (qic.family.Component, issue 30's family seam): a STAND-IN component,
`toy_encoder` (not a Qwen-Image part: a linear layer over a per-resolution token grid), added to the family by
its definition alone, is planned by every build stage with no other edit: its graph jobs and their shapes, spec
keys over its declared config deps, its dtype rule, its TP plan, qic plan's figures, the neuron flags and the
eager stand-in's graphs (by its own graph maker). An unknown component name is one ConfigError line."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qic import family
from qic.builder.graphs import GraphDef
from qic.checkpoint.presets import preset
from qic.dtypes import TORCH_DTYPES
from qic.errors import ConfigError
from qic.graph_names import graph_name
from qic.models.qwen_image import components as qwen_image
from qic.spec import parse_spec

TOY = "toy_encoder"   # the stand-in's name
DIM = 8


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    dim: int

    @classmethod
    def from_dict(cls, raw):
        return cls(int(raw["dim"]))


class ToyEncoder(nn.Module):
    """One rank's part of a column-parallel projection: dim / tp_size output rows."""

    def __init__(self, config: ToyConfig, tp_size: int = 1, looped: bool = False):
        super().__init__()
        self.proj = nn.Linear(config.dim, config.dim // tp_size)

    def forward(self, x):
        return self.proj(x)


def _toy_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} for h, w in spec.resolutions]


def _toy_graph(module, configs, shape, dtype, layout) -> GraphDef:
    h, w = shape["resolution"]
    tokens = (h // 16) * (w // 16)
    x = torch.zeros(1, tokens, configs[TOY].dim, dtype=TORCH_DTYPES[dtype])
    return GraphDef(graph_name(TOY, (h, w)), TOY, module, [("x", x)], ["y"], shape=dict(shape))


# The one definition: nothing else in qic names the stand-in.
TOY_DEF = family.Component(
    TOY, "toy", ToyConfig.from_dict, ToyEncoder, dict, ("common.py",), _toy_shapes, _toy_graph,
    config_deps=("toy", "vae"), tp_plan=family.TPPlan(rules=((r"proj\.(weight|bias)", family.COLUMN),)),
    fixed_dtype="float32", neuron_model_type="transformer")


@pytest.fixture
def toy(monkeypatch):
    """The stand-in in Qwen-Image's definitions, that family the one being built (an in-process build of another
    family earlier in this worker leaves its own current: qic.family.use), both undone after."""
    monkeypatch.setitem(qwen_image.COMPONENTS, TOY, TOY_DEF)
    before = family.current()
    family.use("qwen-image")
    yield TOY_DEF
    family.use(before)


def _raw(dim: int = DIM) -> dict:
    """Configs by checkpoint folder: the tiny preset's, plus the stand-in's folder."""
    return {f: preset("tiny")[f] for f in ("text_encoder", "transformer", "vae")} | {"toy": {"dim": dim}}


def _plan(spec, raw):
    from qic.backends import backend_for
    from qic.builder.jobs import plan_jobs
    configs = {n: c.parse_config(raw[c.folder]) for n, c in family.components().items()}
    return plan_jobs(spec, configs, raw, backend_for(spec)), configs


def _spec(**over):
    return parse_spec({"components": [TOY], "resolutions": ["48x80", "32x48"], "tp": 2, "dtype": "bfloat16"} | over)


def test_the_build_plans_a_component_added_by_its_definition_alone(toy):
    jobs, configs = _plan(_spec(), _raw())
    assert [(j.component, j.name, j.shape) for j in jobs] == [
        (TOY, "toy_encoder@48x80", {"resolution": [48, 80]}), (TOY, "toy_encoder@32x48", {"resolution": [32, 48]})]
    # Its graph maker, through the one make_graph every stage uses: a module of the rank's (TP 2) shapes.
    gdef = jobs[0].maker(ToyEncoder(configs[TOY], tp_size=2))
    assert gdef.name == jobs[0].name and tuple(gdef.module(*[t for _, t in gdef.inputs]).shape) == (1, 15, DIM // 2)

    def keys(spec=None, raw=None):
        return [j.spec_key for j in _plan(spec or _spec(), raw or _raw())[0]]

    # Spec keys cover exactly its declared config deps (its folder and the VAE's), not the other folders.
    assert keys(raw=_raw(dim=16)) != keys()
    assert keys(raw=_raw() | {"vae": {**_raw()["vae"], "_probe": 1}}) != keys()
    assert keys(raw=_raw() | {"text_encoder": {**_raw()["text_encoder"], "_probe": 1}}) == keys()
    # Its dtype rule: fixed at fp32, so a bf16 build keys (and shards) it as fp32; without the rule it differs.
    assert keys(_spec(dtype="float32")) == keys()
    qwen_image.COMPONENTS[TOY] = dataclasses.replace(TOY_DEF, fixed_dtype=None)
    assert keys(_spec(dtype="float32")) != keys()


def test_its_tp_plan_dtype_and_neuron_type_are_read_from_the_definition(toy):
    from qic.backends.neuron.cc import component_flags
    from qic.builder.context import tp_of
    from qic.builder.memplan import plan_memory
    from qic.parallel import plans
    from qic.parallel.tp import shard_state_dict
    assert tp_of(TOY, 2) == 2
    w = torch.arange(DIM * DIM, dtype=torch.float32).reshape(DIM, DIM)
    assert torch.equal(plans.rank_slice(TOY, "proj.weight", w, 1, 2), w[DIM // 2:])
    assert torch.equal(shard_state_dict(TOY, {"proj.weight": w}, 1, 2)["proj.weight"], w[DIM // 2:])
    assert component_flags(TOY)[component_flags(TOY).index("--model-type") + 1] == "transformer"
    spec = _spec()
    jobs, configs = _plan(spec, _raw())
    plan = plan_memory(spec, configs, _raw(), None, jobs)
    (toy_plan,) = plan.components
    # One rank's half of the projection (4 x 8 weight, 4 bias), in the fixed fp32 of a bf16 build.
    assert (toy_plan.name, toy_plan.dtype, toy_plan.ranks) == (TOY, "float32", 2)
    assert toy_plan.bytes_per_rank == (DIM // 2) * (DIM + 1) * 4
    # A replicated definition (no TP table): one shard, compiled once, whatever the build's TP.
    qwen_image.COMPONENTS[TOY] = dataclasses.replace(TOY_DEF, tp_plan=family.TPPlan())
    assert tp_of(TOY, 2) == 1 and torch.equal(plans.rank_slice(TOY, "proj.weight", w, 1, 2), w)


def test_the_eager_stand_in_makes_its_graphs_with_its_own_maker(toy, tiny_ckpt, tmp_path):
    from qic.builder.eager import EagerModel
    root = tmp_path / "ckpt"
    root.mkdir()
    for entry in tiny_ckpt.iterdir():
        os.symlink(entry, root / entry.name)
    (root / "toy").mkdir()
    (root / "toy" / "config.json").write_text(f'{{"dim": {DIM}}}')
    weights = {"proj.weight": torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(0)),
               "proj.bias": torch.randn(DIM, generator=torch.Generator().manual_seed(1))}
    save_file(weights, str(root / "toy" / "model.safetensors"))
    model = EagerModel(root, [(48, 80)], [72], dtype="bfloat16")
    graph = model.graph(TOY, (48, 80))
    assert graph.inputs == [{"name": "x", "shape": [1, 15, DIM], "dtype": "torch.float32"}]   # fp32: its rule
    x = torch.randn(1, 15, DIM, generator=torch.Generator().manual_seed(2))
    (y,) = graph(x)
    # The checkpoint's weights through the stand-in's module, in fp32: the same ops, so the same bits.
    assert torch.equal(y, torch.nn.functional.linear(x, weights["proj.weight"], weights["proj.bias"]))


def test_an_unknown_component_is_one_config_error_line():
    from qic.backends.neuron.cc import component_flags
    from qic.builder.context import tp_of
    from qic.builder.graphs import make_graph
    from qic.parallel import plans
    known = "known: text_encoder, denoiser, vae_decoder"
    for call in (lambda: family.component(TOY), lambda: tp_of("unet", 2), lambda: plans.split_dim("unet", "w"),
                 lambda: component_flags("unet"), lambda: make_graph("unet", None, {}, {}, "float32")):
        with pytest.raises(ConfigError) as e:
            call()
        assert "\n" not in str(e.value) and "unknown component '" in str(e.value) and known in str(e.value)
    with pytest.raises(ConfigError, match=r"components 'toy_encoder' is not one of: text_encoder, denoiser"):
        parse_spec({"components": [TOY]})   # the stand-in is no component until its definition is added
