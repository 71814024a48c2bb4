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
