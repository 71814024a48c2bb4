"""Qwen-Image-2.1's denoiser graphs (prefill and decode, looped) lowered and checked on XLA:CPU, right and broken
(run with .venv-xla's python; tests/test_neuron_xla_q21.py asserts on the JSON it prints).

    python -m benchmarks.xla_lowering_q21 sensitivity   # the build's check passes the graphs and fails broken ones
    python -m benchmarks.xla_lowering_q21 depth         # HLO bytes and While count at 2 and 8 blocks

A tiny config (tests/qwen_image_21_checkpoint.py's transformer: 6 heads of 16, 3 a rank at TP 2), weights drawn by
benchmarks.xla_lowering._random, the check's own sample (qic.models.qwen_image_21.graphs.denoiser_sample).
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.xla_lowering import _random
from qic.backends.neuron import hlo_proto
from qic.backends.neuron import lower as xl
from qic.backends.neuron.build import NeuronBackend
from qic.models.qwen_image_21.components import COMPONENTS
from qic.models.qwen_image_21.graphs import DECODE, PREFILL, denoiser_graph

# tests/qwen_image_21_checkpoint.py's TRANSFORMER_CONFIG (not imported: that module is test code)
CONFIG = dict(num_layers=2, attention_head_dim=16, num_attention_heads=6, in_channels=16, out_channels=16,
              context_in_dim=48, mlp_ratio=3, axes_dims_rope=[4, 6, 6])
SIZE, BUCKET = (64, 64), 64


def _model(layers: int = 2):
    config = COMPONENTS["denoiser"].parse_config({**CONFIG, "num_layers": layers})
    return config, _random(COMPONENTS["denoiser"].make_module(config, looped=True))


def _tensors(module) -> dict:
    return dict(module.named_parameters())


def _full_attention(block_ids, key_valid, dtype=torch.float32):
    """The broken rule: every prefix query sees every real prefix key (no causality over the text)."""
    from qic.models.qwen_image_21.denoiser import _bias
    n = block_ids.shape[0]
    allowed = torch.ones(n, n, dtype=torch.bool, device=block_ids.device)
    return _bias(allowed[None, None] & key_valid[:, None, None, :], dtype)


def sensitivity() -> dict:
    """Per graph, the build's check (NeuronBackend.check: rel-L2 against eager <= its bound) on the graph as
    lowered, and on broken ones: the prefill lowered with full attention over the prefix instead of the
    block-causal bias, and with the prefix modulated at t instead of 0; the decode fed another prompt's K/V
    (what the runtime would do with a stale prefix). Also the right graphs' figures at t = 0.5 and 1 (the time
    embedding's angles 1000 t f_k, whose fp32 ulps the check's small t keeps below the bound)."""
    backend = NeuronBackend.__new__(NeuronBackend)
    config, model = _model()
    out = {}
    for part in (PREFILL, DECODE):
        g = denoiser_graph(model, config, *SIZE, BUCKET, part, "float32")
        tensors = _tensors(g.module)
        low = xl.lower(g.module, g.inputs, tensors)
        r = {"right": _figures(backend.check(low, g.module, g.inputs, tensors, sample=g.sample))}
        for t in (0.5, 1.0):
            def at(t=t):
                return [(n, torch.full((1,), t) if n == "timestep" else v) for n, v in g.sample()]
            r[f"t={t}"] = _figures(backend.check(low, g.module, g.inputs, tensors, sample=at))
        if part == PREFILL:
            for case, attr, broken in (("full_attention", "prefix_attention_bias", _full_attention),
                                       ("prefix_at_t", "prefix_timestep", lambda t: t)):
                setattr(model, attr, broken)   # an instance attribute shadows the model's rule
                try:
                    bad = xl.lower(g.module, g.inputs, tensors)
                finally:
                    delattr(model, attr)
                r[case] = _figures(backend.check(bad, g.module, g.inputs, tensors, sample=g.sample))
        else:
            r["stale_kv"] = _figures(_stale_kv(low, g, tensors))
        out[part] = r
    return out


def _stale_kv(low, g, tensors) -> dict:
    """The decode on XLA:CPU with the K/V of another prompt's prefill (other text rows, same everything else)
    against eager with the right ones, measured as the build's check measures."""
    from qic.backends.neuron.build import XLA_CPU_REL_L2, _rel
    sample = g.sample()
    model = g.module.model
    prefill = denoiser_graph(model, model.config, *SIZE, BUCKET, PREFILL, "float32")
    feed = dict(prefill.sample())
    kv = []
    for seed in (0, 1):   # the right prompt's K/V and another's
        text = torch.randn(feed["text"].shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            _, k, v = torch.func.functional_call(prefill.module, tensors,
                                                 tuple(text if n == "text" else t for n, t in feed.items()))
        kv.append({"k": k, "v": v})
    right = [(n, kv[0].get(n, t)) for n, t in sample]
    stale = [(n, kv[1].get(n, t)) for n, t in sample]
    got = xl.execute(low.proto, low.values(stale, tensors))[0]
    with torch.no_grad():
        want = torch.func.functional_call(g.module, tensors, tuple(t for _, t in right))
    rel = _rel(got, want)
    return {"xla_cpu_rel_l2": rel, "ok": rel <= XLA_CPU_REL_L2}


def _figures(check: dict) -> dict:
    return {"rel_l2": check["xla_cpu_rel_l2"], "ok": check["ok"]}


def depth(sizes=(2, 8)) -> dict:
    """The looped prefill and decode HLO at two depths: bytes and While count (flat in depth: one body)."""
    out = {}
    for layers in sizes:
        config, model = _model(layers)
        for part in (PREFILL, DECODE):
            g = denoiser_graph(model, config, *SIZE, BUCKET, part, "float32")
            low = xl.lower(g.module, g.inputs, _tensors(g.module))
            out[f"{part}@{layers}"] = {"hlo_bytes": len(low.proto), "while": hlo_proto.opcodes(low.proto)["while"]}
    return out


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "sensitivity"
    result = {"sensitivity": sensitivity, "depth": depth}[what]()
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
