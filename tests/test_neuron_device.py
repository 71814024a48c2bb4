"""Opt-in, on a Trainium host only (QIC_NEURON_DEVICE_TEST=1, with neuronx-cc on PATH and libnrt): the
embedded model built with the neuron back end, compiled to NEFFs, run on a NeuronCore, and compared with
the inductor bundle's image. Never run here (no Trainium); docs/neuron.md says so."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from tests.conftest import BUCKETS, SHORT_PROMPT, TINY_RES, image_diff, qic
from tests.test_neuron_xla import xla_qic

pytestmark = pytest.mark.skipif(os.environ.get("QIC_NEURON_DEVICE_TEST") != "1",
                                reason="opt-in: set QIC_NEURON_DEVICE_TEST=1 on a Trainium host")


def test_neff_image_on_device_matches_inductor(bundle, workdir, tiny_ckpt):
    out = workdir / "bundle-neuron-device"
    xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", workdir / "cache-neuron-device",
            "--output", out, "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", ",".join(map(str, BUCKETS)))
    assert json.loads((out / "manifest.json").read_text())["lower_only"] is False, "neuronx-cc was not found"
    common = ["--prompt", SHORT_PROMPT, "--steps", "4", "--seed", "3"]
    xla_qic("run", out, "--device", "neuron", *common, "--output", workdir / "neuron.png")
    qic("run", bundle, *common, "--output", workdir / "inductor-dev.png")
    worst, mean = image_diff(Image.open(workdir / "neuron.png"), Image.open(workdir / "inductor-dev.png"))
    print(f"NeuronCore vs inductor: max {worst:.0f}/255, mean {mean / 255:.5f}")
    assert worst <= 2 and mean / 255 <= 0.02
