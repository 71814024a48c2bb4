"""The neuron back end's Trainium half end to end, against FAKES: the recording FAKE neuronx-cc
(tests/fakes/neuronx-cc, on PATH) compiles the lowered graphs into fake NEFFs, and the FAKE libnrt
(tests/fakes/fake_libnrt.c) loads them per rank. Neither is Neuron software: they check the commands,
flags, file layout, call order and per-rank weights, never the numerics (XLA:CPU checks those:
test_neuron_xla.py). Lowering itself is real (torch-xla in .venv-xla).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import TINY_RES
from tests.test_neuron_loader_fake import fnv1a64
from tests.test_neuron_xla import xla

pytestmark = pytest.mark.slow   # builds neuron bundles (lowering on XLA:CPU) and runs them through a fake runtime

FAKES = Path(__file__).resolve().parent / "fakes"
ROOT = Path(__file__).resolve().parent.parent


def fake_env(log: Path) -> dict:
    return {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "QIC_FAKE_NEURONXCC_LOG": str(log)}


def build(ckpt, cache, out, *extra, env=None):
    return xla("-m", "qic.cli", "build", "--backend", "neuron", "--model", ckpt, "--cache-dir", cache,
               "--output", out, "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "128,", *extra, env=env)


def compiles(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [c for c in map(json.loads, log.read_text().splitlines()) if c["argv"][:1] == ["compile"]]


@pytest.fixture(scope="module")
def fake_builds(tmp_path_factory, tiny_ckpt):
    """A lower-only build, then the same build with the FAKE neuronx-cc on PATH, then once more."""
    tmp = tmp_path_factory.mktemp("neuron-fake")
    cache, log = tmp / "cache", tmp / "neuronx-cc.jsonl"
    first = build(tiny_ckpt, cache, tmp / "lower-only")
    second = build(tiny_ckpt, cache, tmp / "bundle", env=fake_env(log))
    after_second = compiles(log)
    third = build(tiny_ckpt, cache, tmp / "bundle", env=fake_env(log))
    return tmp, first, second, after_second, third, compiles(log)


def test_fake_neuronx_cc_commands_flags_and_layout(fake_builds):
    tmp, first, second, calls, _, _ = fake_builds
    assert "lower-only" in first.stdout + first.stderr
    m = json.loads((tmp / "bundle" / "manifest.json").read_text())
    assert m["lower_only"] is False and m["neuron"]["neuronx_cc"].startswith("2.")
    assert "warning:" not in second.stdout + second.stderr
    assert len(calls) == len(m["graphs"]) == 3
    for call in calls:
        argv = call["argv"]
        hlo = Path(argv[1])
        assert hlo.name == "model.hlo_module.pb" and hlo.parent.parent.name == "graphs"   # from the cache
        flags = shlex.join(argv[2:])
        assert "--framework XLA --target trn2" in flags and "-O1" in flags and "--auto-cast none" in flags
        assert "--output model.neff" in flags and "--logfile log-neuron-cc.txt" in flags
    kinds = sorted(a for c in calls for a in c["argv"] if a in ("transformer", "unet-inference"))
    assert kinds == ["transformer", "transformer", "unet-inference"]
    for g in m["graphs"]:
        folder = tmp / "bundle" / "graphs" / g["name"]
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["constants.safetensors", "model.hlo_module.pb", "model.neff", "params.json"])
        assert g["neff"] == f"graphs/{g['name']}/model.neff" and g["compiler"]["flags"]


def test_lower_only_then_compiler_recompiles_nothing_lowered(fake_builds):
    _, first, second, calls, third, calls_after_third = fake_builds
    # The second build found every lowered graph in the cache (shards and graphs all hits)...
    rows = [line for line in second.stdout.splitlines() if line.startswith("│ compile ")]
    assert rows and all("cached" in r for r in rows), second.stdout
    # ...and the third compiled no NEFF either.
    assert calls_after_third == calls and "100% hits" in third.stdout


# Each rank loads the bundle as `qic run --tp N` would (qic.runtime.bundle.Bundle, device neuron) and calls
# its denoiser graph once; the FAKE libnrt logs what it was handed.
RANK = r"""
import os, sys, json, torch
from qic.runtime.bundle import Bundle
bundle, rank, world, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["QIC_FAKE_LIBNRT_LOG"] = log
b = Bundle(bundle, device="neuron", rank=rank, world=world)
g = next(g for k, g in b.graphs.items() if k[0] == "denoiser")
x = [torch.full(i["shape"], 0.25).to(getattr(torch, i["dtype"])) for i in g.inputs]
out = g(*x)[0].flatten()[:3].tolist()
forbidden = sorted(m for m in sys.modules if m.split(".")[0] in ("torch_xla", "torch_neuronx", "diffusers")
                   or m.startswith(("qic.models", "qic.builder", "torch._inductor")))
print(json.dumps({"out": out, "forbidden": forbidden}))
"""


@pytest.mark.parametrize("tp", [1, 4])
def test_fake_libnrt_loads_each_ranks_weights(tp, tmp_path, tiny_ckpt, fake_libnrt):
    out = tmp_path / f"bundle-tp{tp}"
    components = ["--components", "denoiser"] if tp > 1 else []   # the tiny text encoder has 2 KV heads
    build(tiny_ckpt, tmp_path / "cache", out, "--tp", tp, *components, env=fake_env(tmp_path / "cc.jsonl"))
    m = json.loads((out / "manifest.json").read_text())
    g = next(g for g in m["graphs"] if g["component"] == "denoiser")
    params = json.loads((out / g["params"]).read_text())["params"]
    procs = []
    for r in range(tp):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "QIC_LIBNRT": str(fake_libnrt)}
        procs.append(subprocess.Popen([str(ROOT / ".venv-xla" / "bin" / "python"), "-c", RANK, str(out), str(r),
                                       str(tp), str(tmp_path / f"nrt{r}.jsonl")], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["forbidden"] == []   # the runtime loads, never compiles
    for r in range(tp):
        calls = [json.loads(x) for x in (tmp_path / f"nrt{r}.jsonl").read_text().splitlines()]
        init = calls[0]
        assert init["call"] == "nrt_init" and init["visible_cores"] == str(r)
        load = next(c for c in calls if c["call"].startswith("nrt_load"))
        if tp == 1:
            assert load["call"] == "nrt_load"
        else:
            assert load["call"] == "nrt_load_collectives" and init["comm_id"]
            assert (load["rank"], load["world"]) == (r, tp)
        # The rank's own shard, byte for byte, each weight written once, at the NEFF input of its HLO parameter.
        shard = out / (g["weights"][r] if len(g["weights"]) > 1 else g["weights"][0])
        consts = out / g["constants_file"]
        tensors = {}
        for f, prefix in ((shard, g["weight_prefix"]), (consts, "")):
            with safe_open(str(f), "pt") as h:
                tensors.update({prefix + k: h.get_tensor(k) for k in h.keys()})
        # The bundle loads its graphs in manifest order, each writing its weights right after its load.
        loads = [i for i, c in enumerate(calls) if c["call"].startswith("nrt_load")]
        k = [x["name"] for x in m["graphs"]].index(g["name"])
        segment = calls[loads[k]:loads[k + 1] if k + 1 < len(loads) else len(calls)]
        writes = {c["name"]: c["fnv1a64"] for c in segment if c["call"] == "nrt_tensor_write"}
        for i, (kind, j) in enumerate(params):
            if kind == "weight":
                t = tensors[g["weight_inputs"][j]].contiguous()
                assert writes[f"input{i}"] == fnv1a64(t.view(-1).view(torch.uint8).numpy().tobytes()), \
                    (r, i, g["weight_inputs"][j], t.dtype, tuple(t.shape))
