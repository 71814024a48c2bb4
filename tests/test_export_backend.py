"""The export back end (qic/backends/export/): each graph's torch.export program saved without weights and run by
torch. Built here with a C++ compiler that refuses (tests/fakes/refusing_cxx), so a build that compiled anything
would fail; its images are diffusers' within the bounds `qic run`'s compiled bundles are held to."""

from __future__ import annotations

import json

import pytest
import torch

from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
from tests.conftest import BUCKETS, TINY_RES, diffusers_image, image_diff, qic
from tests.test_run import BOUND, SHORT
from tests.tiers import REFUSING_CXX

STEPS = 4
SIZE = "{}x{}".format(*TINY_RES)


def _build(tiny_ckpt, out, *args) -> str:
    return qic("build", "--model", tiny_ckpt, "--backend", "export", "--resolution", SIZE, "--text-buckets",
               BUCKETS[0], "--cache-dir", out.parent / "cache", "--output", out, *args,
               env={"CXX": str(REFUSING_CXX)}).stdout


@pytest.fixture(scope="module")
def export_bundle(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "bundle"
    _build(tiny_ckpt, out)
    return out


def test_an_export_bundle_holds_programs_without_weights(export_bundle):
    manifest = json.loads((export_bundle / "manifest.json").read_text())
    assert manifest["backend"]["backend"] == "export"
    assert {g["component"] for g in manifest["graphs"]} == {"text_encoder", "denoiser", "vae_decoder"}
    for g in manifest["graphs"]:
        program = torch.export.load(str(export_bundle / g["file"]))
        # The weights are the graph's trailing inputs, bound at load from the bundle's shards: none is saved with
        # the program (export lists the module's own, unread, and saveable() drops them).
        assert not program.state_dict and not program.graph_signature.parameters, g["name"]
        assert len(g["weight_inputs"]) > 0


def test_an_export_bundle_draws_diffusers_image(export_bundle, tiny_ckpt, tmp_path):
    h, w = TINY_RES
    image = generate(Bundle(export_bundle), Request(SHORT, steps=STEPS, seed=3, height=h, width=w)).image
    ref = diffusers_image(tiny_ckpt, SHORT, " ", 4.0, seed=3, steps=STEPS, height=h, width=w)
    mx, mean = image_diff(image, ref)
    print(f"export bundle vs diffusers: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND and mean < 0.05
    other = diffusers_image(tiny_ckpt, SHORT, " ", 4.0, seed=4, steps=STEPS, height=h, width=w)
    assert image_diff(image, other)[0] > BOUND   # the bound can fail: another seed breaks it
    # The CLI runs the same programs in a fresh process: the same image to the level.
    png = tmp_path / "cli.png"
    qic("run", export_bundle, "--prompt", SHORT, "--steps", STEPS, "--seed", 3, "--output", png)
    from PIL import Image
    assert image_diff(Image.open(png).convert("RGB"), image) == (0.0, 0.0)
    assert "export" in qic("inspect", export_bundle).stdout


@pytest.mark.slow
def test_an_export_bundle_at_tp_2_draws_tp_1s_image(export_bundle, tiny_ckpt, tmp_path):
    # The TP graphs' collectives run eagerly on the ranks' gloo group (the aliases the runtime registers).
    tp2 = tmp_path / "tp2"
    _build(tiny_ckpt, tp2, "--tp", 2)
    png1, png2 = tmp_path / "tp1.png", tmp_path / "tp2.png"
    for bundle, png in ((export_bundle, png1), (tp2, png2)):
        qic("run", bundle, "--prompt", SHORT, "--steps", STEPS, "--seed", 3, "--output", png)
    from PIL import Image
    one, two = Image.open(png1).convert("RGB"), Image.open(png2).convert("RGB")
    mx, mean = image_diff(one, two)
    print(f"export TP 2 vs TP 1: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND and mean < 0.05


def test_a_run_reads_only_the_programs_it_calls(bundle_two_res, monkeypatch):
    """A program is read back at its first call: opening a bundle of two resolutions and two buckets reads none,
    a request refused before any graph runs (a size the bundle lacks) reads none, and an image at one size and
    bucket reads its text encoder, step and decoder only, once each (a second image reads nothing more)."""
    from qic.errors import QicError
    reads = []
    real = torch.export.load
    monkeypatch.setattr(torch.export, "load", lambda path, *a, **kw: reads.append(path) or real(path, *a, **kw))
    bundle = Bundle(bundle_two_res[0])
    assert len(bundle.graphs) == 8 and reads == []
    with pytest.raises(QicError):
        generate(bundle, Request(SHORT, steps=2, height=64, width=64))
    assert reads == []
    for seed in (0, 1):
        generate(bundle, Request(SHORT, steps=2, seed=seed, height=TINY_RES[0], width=TINY_RES[1]))
    files = {str(bundle.path / g["file"]): g["name"] for g in bundle.manifest["graphs"]}
    assert sorted(files[p] for p in reads) == ["denoiser@{}x{}@L72".format(*TINY_RES), "text_encoder@L72",
                                               "vae_decoder@{}x{}".format(*TINY_RES)], reads
