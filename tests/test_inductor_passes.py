"""qic's post-grad pass for CPU graphs (qic/backends/inductor/passes.py): what it rewrites, what it leaves,
that the arithmetic stays eager's, and that it is part of every CPU artifact's key. No compiling here:
the pass runs on a traced aten graph; tests/test_run.py's diffusers parity covers the compiled bundles."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from qic.backends.inductor import PASSES_FILE
from qic.backends.inductor.build import InductorBackend
from qic.backends.inductor.passes import UnfuseCpuBiasAddmm

aten = torch.ops.aten


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (192, 96), (192,), (96, 192), (96,)]
    return [torch.randn(*s, generator=g).to(device) for s in shapes]


def test_cpu_addmm_becomes_mm_plus_add_with_eager_values():
    args = _inputs()
    gm = make_fx(_mlp, tracing_mode="fake")(*args)
    assert _targets(gm).count(aten.addmm.default) == 2
    UnfuseCpuBiasAddmm()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert aten.addmm.default not in targets and targets.count(aten.mm.default) == 2
    want = _mlp(*args)
    got = gm(*args)
    # One fp32 addition per element moves (bias + sum vs sum + bias): at most an ulp of the sum's
    # magnitude per Linear; through the second Linear's 192-term sums that stays far below 1e-5 relative.
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel
    # the check can fail: a bias dropped by a wrong rewrite is far outside the bound
    wrong = _mlp(args[0], args[1], torch.zeros_like(args[2]), args[3], args[4])
    assert ((wrong - want).norm() / want.norm()).item() > 1e-2


def test_non_cpu_graphs_and_scaled_addmm_are_left_alone():
    gm = make_fx(_mlp, tracing_mode="fake")(*_inputs("meta"))   # not a CPU graph (GPUs have inductor's own)
    UnfuseCpuBiasAddmm()(gm.graph)
    assert _targets(gm).count(aten.addmm.default) == 2

    def scaled(x, w, b):
        return torch.addmm(b, x, w, beta=0.5, alpha=2.0)
    a = _inputs()
    gm = make_fx(scaled, tracing_mode="fake")(a[0], a[1].T.contiguous(), a[2])
    UnfuseCpuBiasAddmm()(gm.graph)
    assert aten.addmm.default in _targets(gm)


def test_the_pass_is_in_every_cpu_artifact_identity():
    digest = hashlib.sha256(PASSES_FILE.read_bytes()).hexdigest()[:16]
    assert InductorBackend("cpu").identity()["passes"] == {"unfuse_cpu_bias_addmm": digest}


class _Scale(torch.nn.Module):
    """y = x * w, w a parameter (a weight, bound at load); with `baked`, also + b, a buffer the graph would hold."""

    def __init__(self, baked: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 2.0))
        if baked:
            self.register_buffer("b", torch.ones(4))
        self.baked = baked

    def forward(self, x):
        return x * self.w + (self.b if self.baked else 0)


def test_a_graph_holding_a_tensor_of_its_own_is_refused_before_compiling(tmp_path):
    """The build's check that no weight is a graph constant (a baked value would pin one checkpoint's): done on the
    exported program, so a refused graph never compiles, and a graph taking every tensor as input passes."""
    from types import SimpleNamespace

    from qic.backends.inductor.build import baked_tensors
    backend = InductorBackend("cpu")
    for baked in (False, True):
        module = _Scale(baked)
        gdef = SimpleNamespace(module=module, inputs=[("x", torch.randn(3, 4))], dynamic=None)
        traced = backend.trace(gdef, {"w": module.w.detach()})
        assert baked_tensors(traced.payload) == (["module.b"] if baked else [])
    with pytest.raises(RuntimeError, match=r"holds tensors of its own \['module.b'\]"):
        backend.compile(traced, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_wrapped_number_is_not_a_baked_tensor_but_a_tensor_attribute_is():
    """torch.tensor(1e6) in forward (RoPE's theta) is a 0-dim lifted constant inductor inlines; a tensor kept as a
    plain attribute (not a parameter or buffer) is a lifted constant the package would hold."""
    from qic.backends.inductor.build import baked_tensors

    class Wrapped(torch.nn.Module):
        def __init__(self, table: bool):
            super().__init__()
            self.table = torch.arange(4.0) if table else None

        def forward(self, x):
            y = x * torch.tensor(1e6)
            return y + self.table if self.table is not None else y

    for table in (False, True):
        program = torch.export.export(Wrapped(table), (torch.randn(4),), strict=False)
        assert bool(baked_tensors(program)) == table, baked_tensors(program)
