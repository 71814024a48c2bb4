"""Issue 33: a checkpoint folder as a weight set for a bundle's graphs (`qic build --weights-for BUNDLE --model DIR`,
qic.builder.weight_set), run by `qic run BUNDLE --weights SET` and served by `qic serve BUNDLE --weights NAME=DIR`.
Against a full build of the same checkpoint (its own compiled graphs), the bundle's own weights, and what is
refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from qic.checkpoint.embedded import write_checkpoint
from qic.runtime.bundle import Bundle
from tests.conftest import BUCKETS, TINY_RES, qic

pytestmark = pytest.mark.slow   # builds and runs bundles through the CLI

STEPS = 2


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path), dtype=np.int16)


def _run(bundle, out, *extra) -> np.ndarray:
    qic("run", bundle, *extra, "--prompt", "a red bicycle", "--steps", STEPS, "--seed", 3, "--output", out)
    return _pixels(out)


@pytest.fixture(scope="module")
def seed1_ckpt(tmp_path_factory):
    """The session bundle's architecture (the tiny preset) with other weights (seed 1)."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-seed1", "tiny", seed=1)


def test_a_weight_set_runs_the_bundles_graphs_as_a_full_build_of_its_checkpoint(bundle, cache_dir, seed1_ckpt,
                                                                                   tmp_path):
    made = qic("build", "--weights-for", bundle, "--model", seed1_ckpt, "--output", tmp_path / "set",
               "--cache-dir", cache_dir).stdout
    again = qic("build", "--weights-for", bundle, "--model", seed1_ckpt, "--output", tmp_path / "set",
                "--cache-dir", cache_dir).stdout
    made, again = " ".join(made.split()), " ".join(again.split())   # rich wraps lines at any space
    assert "weight set written" in made and "compile" not in made, made   # nothing compiled
    assert "weight set unchanged" in again, again
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    own = json.loads((bundle / "manifest.json").read_text())
    assert manifest["kind"] == "weights" and manifest["weights_for"] == own["id"]
    assert sorted(manifest["files"]) == sorted({f for g in own["graphs"] for f in g["weights"]})
    # The same checkpoint built in full (its graphs from the compile cache) draws the same pixels.
    qic("build", "--model", seed1_ckpt, "--cache-dir", cache_dir, "--resolution", "{}x{}".format(*TINY_RES),
        "--text-buckets", ",".join(map(str, BUCKETS)), "--output", tmp_path / "full")
    through_set = _run(bundle, tmp_path / "set.png", "--weights", tmp_path / "set")
    full = _run(tmp_path / "full", tmp_path / "full.png")
    own_weights = _run(bundle, tmp_path / "own.png")
    assert np.array_equal(through_set, full)
    assert np.abs(through_set - own_weights).max() > 8   # the comparison tells the weights apart
    shown = qic("inspect", tmp_path / "set").stdout
    assert "weight set" in shown and "all hashes match" in shown, shown
    not_a_bundle = "a weight set (qic build --weights-for), not a bundle"
    _refused(qic("run", tmp_path / "set", "--prompt", "x", check=False), not_a_bundle)
    _refused(qic("build", "--weights-for", tmp_path / "set", "--model", seed1_ckpt, "--output", tmp_path / "s2",
                 check=False), not_a_bundle)
    # As qic serve maps a set (over the loaded bundle's code): the bundle's own tokenizer, not one loaded per map
    # (tokenizers keeps each loaded BPE model's word cache for good: a server mapping sets all day grew by it).
    primary = Bundle(bundle)
    assert Bundle(bundle, weights_from=tmp_path / "set", code_from=primary).tokenizer is primary.tokenizer


@pytest.mark.parametrize("extra, says", [
    (["--model", "{alt}", "--output", "{tmp}/s"], "graphs take"),                  # another architecture
    (["--model", "{ckpt}", "--output", "{tmp}/s", "--resolution", "64x64"], "--resolution is not taken"),
    (["--model", "{ckpt}"], "--output is needed"),
], ids=["other-architecture", "build-setting", "no-output"])
def test_weight_set_refusals_are_one_line(bundle, cache_dir, seed1_ckpt, tiny_alt_ckpt, tmp_path, extra, says):
    fill = {"alt": tiny_alt_ckpt, "ckpt": seed1_ckpt, "tmp": tmp_path}
    _refused(qic("build", "--weights-for", bundle, "--cache-dir", cache_dir, *[e.format(**fill) for e in extra],
                 check=False), says)


def _refused(proc, says: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and says in errors[0] and "Traceback" not in proc.stderr, \
        proc.stderr


def test_a_weight_set_for_a_tp2_bundle_is_cut_per_rank(bundle_tp2, cache_dir, seed1_ckpt, tmp_path):
    """At TP 2 the set holds one file per rank of each cut component, cut as the bundle's were: qic run --tp 2 over it
    draws a full TP 2 build of the same checkpoint's pixels (its graphs from the compile cache)."""
    qic("build", "--weights-for", bundle_tp2, "--model", seed1_ckpt, "--output", tmp_path / "set",
        "--cache-dir", cache_dir)
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    denoiser = next(g["weights"] for g in manifest["graphs"] if g["component"] == "denoiser")
    assert manifest["tp"] == 2 and len(denoiser) == 2
    qic("build", "--model", seed1_ckpt, "--cache-dir", cache_dir, "--tp", "2", "--resolution",
        "{}x{}".format(*TINY_RES), "--text-buckets", "72,", "--output", tmp_path / "full")
    through_set = _run(bundle_tp2, tmp_path / "set.png", "--tp", "2", "--weights", tmp_path / "set")
    assert np.array_equal(through_set, _run(tmp_path / "full", tmp_path / "full.png", "--tp", "2"))
    assert np.abs(through_set - _run(bundle_tp2, tmp_path / "own.png", "--tp", "2")).max() > 8


@pytest.mark.parametrize("layout", [("--cfg-parallel",), ("--ulysses", "2")], ids=["cfg-parallel", "ulysses2"])
def test_a_weight_set_for_cfg_parallel_and_ulysses_bundles(tiny_ckpt, cache_dir, seed1_ckpt, tmp_path, layout):
    """Two ranks an image (each CFG branch, or each half of the sequence, on a rank of its own) run replicated
    weights: the set is cut as the bundle's were (one file a component), and qic run over it draws a full build of
    the same checkpoint with that layout's pixels. Export back end: torch runs the exported programs, nothing is
    compiled."""
    def build(ckpt, out):
        qic("build", "--model", ckpt, "--cache-dir", cache_dir, "--backend", "export", *layout, "--resolution",
            "{}x{}".format(*TINY_RES), "--text-buckets", "72,", "--output", out)
        return out
    bundle = build(tiny_ckpt, tmp_path / "bundle")
    qic("build", "--weights-for", bundle, "--model", seed1_ckpt, "--output", tmp_path / "set", "--cache-dir", cache_dir)
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert all(len(g["weights"]) == 1 for g in manifest["graphs"]), manifest["graphs"]
    through_set = _run(bundle, tmp_path / "set.png", "--weights", tmp_path / "set")
    full = build(seed1_ckpt, tmp_path / "full")
    assert np.array_equal(through_set, _run(full, tmp_path / "full.png"))
    assert np.abs(through_set - _run(bundle, tmp_path / "own.png")).max() > 8
