"""The libnrt loader against a FAKE libnrt (tests/fakes/fake_libnrt.c, built here with gcc): call order,
weights copied once, inputs matched by name index, per-rank weights at TP 1 and 4, and a missing
library. The fake runs no NEFF; its documented execute rule (output0 = input0 + sum k * input<k>[0])
only makes the order of the bytes the loader hands it checkable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qic.errors import BundleError

ROOT = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"
N_WEIGHTS = 11          # 2 graph inputs + 11 weights: NEFF names input0..input12, listed input10 before input2
F32, I64 = 0xA, 0xC     # nrt dtype codes (current nrt.h)

# One process imports torch and the loader once, then forks one child per rank (libnrt state is per
# process, as on a device). Each child loads the fake NEFF with its rank's weight shard (memory-mapped,
# as the runtime does), runs it twice, closes, and writes what came back plus any forbidden module the
# loader pulled in.
DRIVER = r"""
import json, os, sys, multiprocessing as mp
import torch
from qic.backends.neuron import nrt as neuron_loader
from qic.weights import mmap_safetensors

def rank_main(neff, shard, rank, world, log, out):
    os.environ["QIC_FAKE_LIBNRT_LOG"] = log
    shards = mmap_safetensors(shard)
    run = neuron_loader.load(neff, [shards[f"w{k}"] for k in range(len(shards))], "neuron", rank=rank, world=world)
    x0 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    outs = [run([x0 + i, torch.full((4,), 0.5)]) for i in range(2)]
    run.close()
    error = None
    if world == 1:   # one weight too many: input1 would receive w0's 4 bytes; refused before any write
        try:
            neuron_loader.load(neff, [shards["w0"]] + [shards[f"w{k}"] for k in range(len(shards))], "neuron")
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    neuron_loader.shutdown()
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch_xla", "torch_neuronx")
                 or m.startswith(("qic.models", "qic.builder")))
    with open(out, "w") as f:
        json.dump({"outs": [[o.tolist() for o in r] for r in outs], "dtypes": [str(o.dtype) for o in outs[0]],
                   "forbidden": bad, "error": error}, f)

if __name__ == "__main__":
    procs = [mp.get_context("fork").Process(target=rank_main, args=tuple(job)) for job in json.loads(sys.argv[1])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
"""


def fake_neff(path: Path) -> Path:
    lines = ["QIC-FAKE-NEFF-IO", f"in input0 {F32} 2 3", f"in input1 {F32} 4"]
    lines += [f"in input{2 + k} {F32} {k + 1}" for k in range(N_WEIGHTS)]
    lines += [f"out output0 {F32} 2 3", f"out output1 {I64} 5"]
    path.write_text("\n".join(lines) + "\n")
    return path


def shard(path: Path, rank: int) -> Path:
    save_file({f"w{k}": torch.full((k + 1,), rank * 100.0 + k) for k in range(N_WEIGHTS)}, str(path))
    return path


def fnv1a64(data: bytes) -> str:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@pytest.fixture(scope="module")
def ranks(fake_libnrt, tmp_path_factory) -> dict:
    """{(world, rank): (result, calls)} for TP 1 and the 4 ranks of TP 4, all run once."""
    tmp = tmp_path_factory.mktemp("ranks")
    neff = fake_neff(tmp / "model.neff")
    jobs = [(str(neff), str(shard(tmp / f"rank{r}.safetensors", r)), r, w, str(tmp / f"nrt-tp{w}-rank{r}.jsonl"),
             str(tmp / f"out-tp{w}-rank{r}.json")) for w, r in [(1, 0), (4, 0), (4, 1), (4, 2), (4, 3)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QIC_LIBNRT": str(fake_libnrt)}
    env.pop("NEURON_RT_ROOT_COMM_ID", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(jobs)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {(w, r): (json.loads(Path(out).read_text()), [json.loads(x) for x in Path(log).read_text().splitlines()])
            for _, _, r, w, log, out in jobs}


def expected_output0(rank: int, step: int) -> list:
    # input1 is 0.5 everywhere; input<2+k> is weight k, filled with rank*100 + k.
    bias = 1 * 0.5 + sum((2 + k) * (rank * 100.0 + k) for k in range(N_WEIGHTS))
    return (torch.arange(6, dtype=torch.float32).reshape(2, 3) + step + bias).tolist()


def test_fake_libnrt_call_order_tp1(ranks):
    result, calls = ranks[(1, 0)]
    names = [c["call"] for c in calls]
    assert names[0] == "nrt_init" and calls[0]["visible_cores"] == "0" and calls[0]["lnc"] == "1"
    assert names[1] == "nrt_load" and calls[1]["vnc_count"] == -1 and "nrt_load_collectives" not in names
    execs = [i for i, n in enumerate(names) if n == "nrt_execute"]
    assert len(execs) == 2
    writes = [c for c in calls if c["call"] == "nrt_tensor_write"]
    weight_writes = [c["name"] for c in writes if c["name"] not in ("input0", "input1")]
    assert sorted(weight_writes) == sorted(f"input{2 + k}" for k in range(N_WEIGHTS))   # each exactly once
    last_weight = max(i for i, c in enumerate(calls) if c["call"] == "nrt_tensor_write"
                      and c["name"] not in ("input0", "input1"))
    assert last_weight < execs[0]                                  # weights before the first call
    for start, end in ((last_weight, execs[0]), (execs[0], execs[1])):   # per call: inputs, execute, outputs
        per_call = calls[start + 1:end]
        assert [c["name"] for c in per_call if c["call"] == "nrt_tensor_write"] == ["input0", "input1"]
    assert [c["call"] for c in calls[execs[1] + 1:execs[1] + 3]] == ["nrt_tensor_read"] * 2
    assert names.index("nrt_unload") > execs[1] and names[-1] == "nrt_close"
    assert result["outs"][0][0] == expected_output0(0, 0) and result["outs"][1][0] == expected_output0(0, 1)
    assert result["dtypes"] == ["torch.float32", "torch.int64"] and result["forbidden"] == []
    assert result["error"].startswith("BundleError: ")
    assert "tensor input1 has 4 bytes, the NEFF expects 16" in result["error"]


def test_fake_libnrt_per_rank_weights_tp4(ranks):
    for rank in range(4):
        result, calls = ranks[(4, rank)]
        init = calls[0]
        assert init["call"] == "nrt_init" and init["visible_cores"] == str(rank)
        assert init["comm_id"] == "localhost:61455"
        load = calls[1]
        assert load["call"] == "nrt_load_collectives" and (load["rank"], load["world"]) == (rank, 4)
        for k in range(N_WEIGHTS):
            want = fnv1a64(torch.full((k + 1,), rank * 100.0 + k).numpy().tobytes())
            got = [c["fnv1a64"] for c in calls if c["call"] == "nrt_tensor_write" and c["name"] == f"input{2 + k}"]
            assert got == [want], f"rank {rank} weight {k}"
        assert result["outs"][0][0] == expected_output0(rank, 0)


def test_missing_libnrt_is_one_line(monkeypatch, tmp_path):
    from qic.backends.neuron import nrt as neuron_loader
    monkeypatch.setenv("QIC_LIBNRT", str(tmp_path / "nope.so"))
    with pytest.raises(BundleError) as e:
        neuron_loader.load(fake_neff(tmp_path / "model.neff"), [], "neuron")
    assert "QIC_LIBNRT=" in e.value.message and "\n" not in str(e.value)
    monkeypatch.delenv("QIC_LIBNRT")
    monkeypatch.setattr(neuron_loader.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(neuron_loader, "DEFAULT_LIBNRT", str(tmp_path / "libnrt.so.1"))
    path, why = neuron_loader.find_library()
    assert path is None and why.startswith("libnrt (the Neuron runtime) not found") and "\n" not in why
