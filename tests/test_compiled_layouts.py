"""Issue 29: compiled bundles with TP inside a layout, and step caching on compiled layouts.

Each world-4 bundle (TP 2 x CFG-parallel 2, TP 2 x Ulysses 2, Ulysses 2 x CFG-parallel 2) is built by `qic build`;
the two with TP inside are run three ways: `qic run` (which starts the four ranks), torchrun (one process per rank)
and `qic serve`; the third is run by `qic run`; TP 2 x CFG-parallel 2 built with `--step-cache 1,0`, and Ulysses 2 x
CFG-parallel 2 so built with the export back end (the decisions are the host program's), run step-cached against
diffusers' FirstBlockCache.

Bounds: a layout changes only how the fp32 sums are split between ranks (TP's partial matmuls, Ulysses' head
split, CFG-parallel's gathered rows), so against the TP 1 bundle an image may move by fp32 reordering only:
within 1/255 with a mean far below a level (measured ~3e-7 rel-L2 on the latents, docs/benchmarks.md). The three
ways of running one bundle run the same graphs in the same order, so their PNGs are equal byte for byte. Against
diffusers' FirstBlockCache the decisions are compared exactly (thresholds 1.1 and 1.2 at bucket 72 sit clear of
every step's figure: tests/test_step_cache.py prints them) and the image is held to the suite's 2/255.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from benchmarks.step_cache import diffusers_pipe, fbc_reference
from qic.parallel.tp import free_port
from tests.conftest import ROOT, SHORT_PROMPT, TINY_RES, _build, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL, outputs_on_collective_buffers
from tests.test_serve import ServeProcess, png_of, request
from tests.test_step_cache import STEPS as CACHE_STEPS
from tests.test_step_cache import _computed, _qic_run

pytestmark = pytest.mark.slow   # compiles every layout's bundle and runs it on ranks

PROMPT, STEPS, SEED = "a small red cube", 4, 5

INSPECT = {   # qic inspect's layout line: the mesh (docs/parallelism.md) written out by hand
    "tp2xcfg2": "layout TP 2 x CFG-parallel 2 (world 4): rank = (cfg * 1 + sp) * 2 + tp; tp groups [[0, 1], [2, 3]]; "
                "cfg groups [[0, 2], [1, 3]]",
    "tp2xu2": "tp groups [[0, 1], [2, 3]]; sp groups [[0, 2], [1, 3]]",
    "u2xcfg2": "sp groups [[0, 1], [2, 3]]; cfg groups [[0, 2], [1, 3]]",
}
LAYOUTS = {   # name: (flags, manifest layout, the step graph's last inputs, built with step caching)
    "tp2xcfg2": (("--tp", "2", "--cfg-parallel"), {"tp": 2, "ulysses": 1, "cfg": 2, "world": 4}, ["cfg_rank"], True),
    "tp2xu2": (("--tp", "2", "--ulysses", "2"), {"tp": 2, "ulysses": 2, "cfg": 1, "world": 4}, ["sp_rank"], False),
    "u2xcfg2": (("--ulysses", "2", "--cfg-parallel"), {"tp": 1, "ulysses": 2, "cfg": 2, "world": 4},
                ["cfg_rank", "sp_rank"], False),
}
# Ulysses 2 x CFG-parallel 2 step-cached, built with the export back end: its test is of the decisions (each CFG
# group's own, a Ulysses group's figure summed over its tokens); compiled split graphs under CFG-parallel are
# tp2xcfg2's, and the compiled U2 x CFG2 step graph is the plain u2xcfg2 bundle's.
EXPORT = "@export"
LAYOUTS["u2xcfg2" + EXPORT] = (LAYOUTS["u2xcfg2"][0] + ("--backend", "export"), *LAYOUTS["u2xcfg2"][1:3], True)
INSPECT["u2xcfg2" + EXPORT] = INSPECT["u2xcfg2"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_bundle(request, bundle, shared_dir, cache_dir, tiny_ckpt):
    """(name, bundle): one resolution, bucket 72 (the text encoder and VAE graphs are cache hits)."""
    name = request.param
    flags, _, _, step_cache = LAYOUTS[name]
    out, _ = _build(shared_dir, f"bundle-{name}", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--resolution",
                    "{}x{}".format(*TINY_RES), "--text-buckets", "72", *flags,
                    *(("--step-cache", "1,0") if step_cache else ()))
    return name, out


@pytest.fixture(scope="module")
def tp1_image(bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1") / "tp1.png"
    qic("run", bundle, "--prompt", PROMPT, "--steps", STEPS, "--seed", SEED, "--output", out)
    return Image.open(out)


def _run_args(steps=STEPS):
    return ("--prompt", PROMPT, "--steps", steps, "--seed", SEED)


def _check_bundle(name, out) -> dict:
    """The manifest's layout and the step graph's rank inputs, qic inspect's layout line, and no graph output on a
    buffer a gloo work still holds (qic/backends/inductor/build.py). Returns the manifest's layout."""
    _, layout, last_inputs, _ = LAYOUTS[name]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layout"] == layout
    step = next(g for g in manifest["graphs"]
                if g["component"] == "denoiser" and not g["name"].endswith(("@head", "@rest", "@mid", "@R1", "@tail")))
    assert [i["name"] for i in step["inputs"]][-len(last_inputs):] == last_inputs
    shown = " ".join(qic("inspect", out, env={"COLUMNS": "300"}).stdout.split())
    assert INSPECT[name] in shown and ("step caching: split graphs" in shown) == LAYOUTS[name][3], shown
    for graph in manifest["graphs"] if not name.endswith(EXPORT) else ():   # AOTInductor packages' buffers
        assert outputs_on_collective_buffers(out / graph["file"]) == [], graph["name"]
    return layout


# The two layouts with TP inside: Ulysses 2 x CFG-parallel 2 runs the same code paths with no TP group, and its
# compiled bundle is held to diffusers' images by the step-caching test below.
@pytest.mark.parametrize("layout_bundle", ["tp2xcfg2", "tp2xu2"], indirect=True)
def test_layout_bundle_runs_as_tp1_by_run_torchrun_and_serve(layout_bundle, tp1_image, tmp_path):
    name, out = layout_bundle
    layout = _check_bundle(name, out)
    qic("run", out, *_run_args(), "--output", tmp_path / "run.png")
    mesh = Image.open(tmp_path / "run.png")
    worst, mean = image_diff(mesh, tp1_image)
    print(f"{name} vs TP 1: max {worst:.0f}/255, mean {mean:.4f} levels")
    assert worst <= 1 and mean <= MEAN_PIXEL, (mean, worst)
    # Under torchrun each process is one rank of the layout's world.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                str(free_port()), "-m", "qic.cli", "run", str(out), *map(str, _run_args()), "--output",
                str(tmp_path / "torchrun.png")]
    proc = subprocess.run(torchrun, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "torchrun.png").read_bytes() == (tmp_path / "run.png").read_bytes()
    bad = qic("run", out, *_run_args(), "--tp", "8", "--output", tmp_path / "x.png", check=False)
    assert bad.returncode == 2 and f"--tp 8 asked for, but the bundle was built for tp={layout['tp']}" in bad.stderr
    # qic serve starts the same four ranks and answers with the PNG qic run writes.
    srv = ServeProcess(out, tmp_path / "serve.log")
    try:
        status, _, body = request(srv.port, "POST", "/v1/images/generations",
                                  {"prompt": PROMPT, "steps": STEPS, "seed": SEED})
        assert status == 200, body
        if LAYOUTS[name][3]:   # step caching through qic serve under the layout: the run's decisions and PNG
            qic("run", out, *_run_args(CACHE_STEPS), "--cache-threshold", 1.2, "--output", tmp_path / "cached.png")
            status, _, cached = request(srv.port, "POST", "/v1/images/generations",
                                        {"prompt": PROMPT, "steps": CACHE_STEPS, "seed": SEED,
                                         "cache_threshold": 1.2})
            assert status == 200, cached
            assert png_of(cached) == (tmp_path / "cached.png").read_bytes()
    finally:
        srv.close()
    assert png_of(body) == (tmp_path / "run.png").read_bytes()


@pytest.fixture(scope="module")
def tiny_pipe(tiny_ckpt):
    return diffusers_pipe(tiny_ckpt)


@pytest.mark.parametrize("layout_bundle", ["u2xcfg2"], indirect=True)
def test_the_compiled_ulysses_x_cfg_parallel_bundle_draws_tp1s_image(layout_bundle, tp1_image, tmp_path):
    """The U2 x CFG2 step graph compiled (its step caching is checked on an export build below)."""
    name, out = layout_bundle
    _check_bundle(name, out)
    qic("run", out, *_run_args(), "--output", tmp_path / "run.png")
    worst, mean = image_diff(Image.open(tmp_path / "run.png"), tp1_image)
    print(f"{name} vs TP 1: max {worst:.0f}/255, mean {mean:.4f} levels")
    assert worst <= 1 and mean <= MEAN_PIXEL, (mean, worst)


# Each step-cached layout at one of the two thresholds (each caches some steps of each branch, and they differ).
@pytest.mark.parametrize("layout_bundle,threshold", [("tp2xcfg2", 1.2), ("u2xcfg2" + EXPORT, 1.1)],
                         indirect=["layout_bundle"])
def test_step_caching_on_a_compiled_layout_decides_as_first_block_cache(layout_bundle, tiny_pipe, tmp_path,
                                                                         threshold):
    """Each CFG group decides its own branch (and a Ulysses group sums its figure over all its tokens): the
    steps each branch computes are diffusers' FirstBlockCache's on one device, the image within 2/255."""
    name, out = layout_bundle
    _check_bundle(name, out)
    ref, ref_computed = fbc_reference(tiny_pipe, threshold, SHORT_PROMPT, CACHE_STEPS, *TINY_RES)
    image, _ = _qic_run(out, tmp_path, "fbc", "--cache-threshold", threshold)
    got = _computed(image)
    print(f"{name} threshold {threshold}: computed {got} | diffusers: {ref_computed}")
    assert got == ref_computed
    assert any(1 < len(c) < CACHE_STEPS for c in got.values()), "nothing cached, or everything"
    worst, mean = image_diff(image, ref)
    print(f"{name} threshold {threshold}: vs diffusers' cached image max {worst:.0f}/255, mean {mean:.4f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (mean, worst)
