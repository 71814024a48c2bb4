"""training/train_shapes.py, the embedded shapes model's trainer: its smoke mode runs every stage and writes
what the package data is, and it never renders a held-out triple (those are only ever drawn by the model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from training import shapes


@pytest.mark.slow
def test_training_smoke_mode_writes_loadable_weights(tmp_path):
    """`python -m training.train_shapes --smoke`: every stage for a few iterations; the files it writes are
    what the package data is (names, shapes, the sha256 in trained.json)."""
    import hashlib

    from safetensors.torch import load_file
    out = tmp_path / "shapes"
    proc = subprocess.run([sys.executable, "-m", "training.train_shapes", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "trained.json").read_text())
    shipped = json.loads((ROOT / "qic" / "checkpoint" / "data" / "shapes" / "trained.json").read_text())
    for name, digest in meta["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
        got = load_file(str(out / name))
        ref = load_file(str(ROOT / "qic" / "checkpoint" / "data" / "shapes" / name))
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in ref.items()}
    assert set(meta["configs"]) == set(shipped["configs"])
    assert meta["training"]["command"].endswith("--smoke")


def test_training_never_sees_a_held_out_triple(monkeypatch):
    """Every picture the training script renders (VAE crops and the denoiser's latents) is of a training
    triple; the held-out 17 are only ever drawn by the model."""
    import types

    import torch

    from training import train_shapes
    drawn = []
    real = shapes.render
    monkeypatch.setattr(shapes, "render", lambda c, s, b, h, w, size: drawn.append((c, s, b)) or real(c, s, b, h, w,
                                                                                                      size))

    class FakeVAE:   # a stand-in encoder: the test is about which pictures are rendered, not their latents
        def encode(self, x):
            z = torch.zeros(x.shape[0], 16, 1, x.shape[-2] // 8, x.shape[-1] // 8)
            return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: z))

    train_shapes.vae_batch(np.random.default_rng(0), 400)
    train_shapes.encode_dataset(FakeVAE(), {"sizes": 1})
    assert len(drawn) == 400 + 3 * len(shapes.TRAIN)
    assert set(drawn) <= set(shapes.TRAIN) and not set(drawn) & set(shapes.HELD_OUT)
    assert set(drawn) == set(shapes.TRAIN)   # and every training triple is used
