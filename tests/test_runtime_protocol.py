"""qic.runtime.protocol: the compiled Bundle and the eager stand-in (EagerModel) implement one interface, the one
the runtime's host program uses, member by member and with the same answers."""

from __future__ import annotations

import inspect
import itertools
import types

import pytest

from qic.builder.eager import EagerModel
from qic.errors import ConfigError
from qic.runtime.bundle import Bundle
from qic.runtime.protocol import GraphFn, Runnable
from tests.conftest import BUCKETS, SECOND_RES, TINY_RES


def _members(proto) -> dict[str, inspect.Signature | None]:
    """The protocol's members: data members (None) and methods (their signatures)."""
    out = {name: None for name in proto.__annotations__}
    for name, value in vars(proto).items():
        if inspect.isfunction(value) and (not name.startswith("_") or name == "__call__"):
            out[name] = inspect.signature(value)
    return out


def _shape(sig: inspect.Signature) -> list:
    """What a caller relies on: the parameters' names, kinds and defaults (annotations are documentation)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def problems(obj, proto) -> list[str]:
    """Every member of `proto` that `obj` lacks, or whose signature differs from the protocol's."""
    out = []
    for name, sig in _members(proto).items():
        if not hasattr(obj, name):
            out.append(f"{name}: missing")
        elif sig is not None:
            want = _shape(sig)[1:]                              # self: bound on the instance
            got = _shape(inspect.signature(getattr(obj, name)))
            if got != want:
                out.append(f"{name}: signature {got} is not the protocol's {want}")
    return out


@pytest.fixture(scope="module")
def both(bundle, tiny_ckpt):
    """The session bundle (one resolution, BUCKETS, the CFG step graph only, batch 1) and an eager stand-in
    holding the same graphs."""
    return Bundle(bundle), EagerModel(tiny_ckpt, [TINY_RES], list(BUCKETS), cfg=(True,), batch_sizes=(1,))


def test_bundle_and_eager_model_implement_the_runtime_protocol(both):
    for model in both:
        assert isinstance(model, Runnable), type(model)
        assert problems(model, Runnable) == [], type(model)
        for graph in (model.graph("text_encoder", bucket=BUCKETS[0]), model.graph("denoiser", TINY_RES, BUCKETS[0]),
                      model.graph("vae_decoder", TINY_RES)):
            assert isinstance(graph, GraphFn) and problems(graph, GraphFn) == [], type(graph)
    # The check can fail: an object lacking any one member, or with a method of another signature.
    eager = both[1]
    names = list(_members(Runnable))
    for name in names:
        partial = types.SimpleNamespace(**{n: getattr(eager, n) for n in names if n != name})
        assert not isinstance(partial, Runnable)
        assert problems(partial, Runnable) == [f"{name}: missing"], name
    narrower = types.SimpleNamespace(**{n: getattr(eager, n) for n in names})
    narrower.has_graph = lambda component, resolution=None, bucket=None, cfg=True, batch=1: True   # no `part`
    assert [p.split(":")[0] for p in problems(narrower, Runnable)] == ["has_graph"]


def test_eager_model_has_graph_answers_as_the_bundle_it_stands_in_for(both):
    """Every graph key the runtime asks about (each component by the keys its graphs are named by), on the built
    and on unbuilt values of each: the same answer."""
    bundle, eager = both
    resolutions, buckets, batches = (TINY_RES, SECOND_RES), (*BUCKETS, 0, 256), (1, 2)
    asks = ([("text_encoder", None, b, True, n, None) for b, n in itertools.product(buckets, batches)]
            + [("vae_decoder", r, None, True, n, None) for r, n in itertools.product(resolutions, batches)]
            + [("denoiser", *key) for key in itertools.product(resolutions, buckets, (True, False), batches,
                                                               (None, "head", "rest", "mixed", "mid", "tail"))])
    held = 0
    for component, res, bucket, cfg, batch, part in asks:
        want = bundle.has_graph(component, res, bucket, cfg=cfg, batch=batch, part=part)
        assert eager.has_graph(component, res, bucket, cfg=cfg, batch=batch, part=part) == want, \
            (component, res, bucket, cfg, batch, part, want)
        held += want
    assert held == 5, held   # the bundle's five graphs (two text encoders, two step graphs, one VAE) are asked
    for model in both:
        model.check_resolution(*TINY_RES)
        with pytest.raises(ConfigError, match=r"resolution 32x48 is not in this .* \(it has: 48x80\)"):
            model.check_resolution(*SECOND_RES)
