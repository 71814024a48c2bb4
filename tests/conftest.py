"""Session fixtures: the embedded checkpoints, diffusers references, and bundles built once.

Compiling is the expensive part of this suite (about 20-30 s a graph on two cores), so bundles are
built once per session into a shared cache, and tests that need a compile reuse them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# OpenMP threads that wait sleep instead of spinning (libgomp reads it when torch loads it; every process the tests
# start inherits it). The suite runs two workers on two cores, each process with two threads: a spinning thread
# takes the core its own team's other thread, or the other worker, needs. Two `qic run`s of 8 images side by side
# took 16.1-17.2 s spinning and 7.3-7.7 s passive (1.0 s more alone; docs/benchmarks.md, "The suite"). The thread
# count, so every number computed, is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Each build compiles its graphs one after another (qic.builder.workers): the suite's two workers already keep both
# cores busy, and a build's compile workers would each import torch again. tests/test_build.py builds with --jobs 2.
os.environ.setdefault("QIC_COMPILE_JOBS", "1")
# Ranks the tests spawn from their own processes (which have computed, so cannot fork them) are forks of one fork
# server that imported torch once, not fresh interpreters that each import it again (qic.parallel.ranks.spawn;
# `qic run` / `qic serve` fork their own ranks whatever this says).
os.environ.setdefault("QIC_RANKS_START", "forkserver")
# Tests run `qic run` in this process (click's CliRunner), where keep_freed_blocks would change malloc for the rest of
# the session and set MALLOC_ variables every later process inherits (benchmarks.peak's measured peaks among them).
# tests/test_heap.py tests it in processes of its own.
os.environ.setdefault("QIC_KEEP_FREED_BLOCKS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests import zygote_client as zygote  # noqa: E402

pytest_plugins = ["tests.tiers", "pytester"]   # the fast and slow tiers, what a run cost; pytester tests the tiers

ROOT = Path(__file__).resolve().parent.parent
QIC = [sys.executable, "-m", "qic.cli"]
FAULTY_QIC = [sys.executable, str(Path(__file__).parent / "fakes" / "faulty_qic.py")]   # a FAKE qic: faults in
TINY_RES = (48, 80)      # (height, width), non-square on purpose
SHORT_PROMPT = "a red bicycle"
SECOND_RES = (32, 48)
BUCKETS = (72, 128)      # the tiny tokenizer's template alone is 53 tokens


def qic(*args, check=True, env=None, **kw) -> subprocess.CompletedProcess:
    """Run the qic command as a user would, in a process of its own; output captured as text. Forked from the
    session's zygote (tests/zygote.py: torch already imported) unless the run asks for what a fork cannot give."""
    argv, full_env = [*QIC, *map(str, args)], {**os.environ, **(env or {})}
    if zygote.forkable(argv, env, **kw):
        proc = zygote.run(argv, full_env, ROOT, kw.get("timeout"))
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=full_env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"qic {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def pixels(image) -> np.ndarray:
    return np.asarray(image).astype(np.float64)


def image_diff(a, b) -> tuple[float, float]:
    """(max, mean) absolute difference in 0..255 pixel units."""
    d = np.abs(pixels(a) - pixels(b))
    return float(d.max()), float(d.mean())


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qic")


@pytest.fixture(scope="session", autouse=True)
def verify_cache(tmp_path_factory) -> Path:
    """The weight-verification records (qic/verified.py) of this session, not the user's ~/.cache."""
    path = tmp_path_factory.mktemp("verified")
    os.environ["QIC_VERIFY_CACHE"] = str(path)
    return path


def xdist_worker() -> str | None:
    """The pytest-xdist worker this process is (`make test` runs the suite on two, `-n 2`), or None."""
    return os.environ.get("PYTEST_XDIST_WORKER")


@pytest.fixture(scope="session")
def shared_dir(workdir, tmp_path_factory) -> Path:
    """Where the session's checkpoints, bundles and compile cache live: `workdir` in a plain run; under
    xdist, one folder of the run's temp root (the parent of each worker's own) that both workers use."""
    if xdist_worker():
        path = tmp_path_factory.getbasetemp().parent / "shared"
        path.mkdir(exist_ok=True)
        return path
    return workdir


def made_once(shared: Path, name: str, make) -> object:
    """`make(shared / name)` run by the first worker that asks, the others waiting on a lock and getting what it
    returned (JSON: a path as a string, a build's stdout), so a session bundle is built once per run and every
    test sees the same build, as in a plain run. A worker whose make failed leaves no record: the next retries."""
    import json

    from qic.fsutil import file_lock, write_bytes_atomic
    record = shared / f"{name}.made.json"
    with file_lock(shared / f"{name}.lock"):
        if not record.exists():
            write_bytes_atomic(record, json.dumps(make(shared / name)).encode())
        return json.loads(record.read_text())


@pytest.fixture(scope="session")
def cache_dir(shared_dir) -> Path:
    """The session's compile cache; under xdist both workers' (a graph one compiled is a hit for the other, and
    two builds of one graph at once compile it once: qic's per-graph lock, as concurrent builds on one machine)."""
    return shared_dir / "cache"


@pytest.fixture(scope="session")
def neuron_cache(shared_dir) -> Path:
    """The session's neuron compile cache (lowered graphs and their XLA:CPU checks), both workers'."""
    return shared_dir / "cache-neuron"


def _checkpoint(shared_dir: Path, name: str, preset: str, **kw) -> Path:
    from qic.checkpoint.embedded import write_checkpoint
    return Path(made_once(shared_dir, name, lambda out: str(write_checkpoint(out, preset, **kw))))


def _build(shared_dir: Path, name: str, *args) -> tuple[Path, str]:
    """`qic build ... --output SHARED/name`, once per run: (the bundle, the build's stdout)."""
    stdout = made_once(shared_dir, name, lambda out: qic("build", *args, "--output", out).stdout)
    return shared_dir / name, stdout


@pytest.fixture(scope="session")
def tiny_ckpt(shared_dir) -> Path:
    return _checkpoint(shared_dir, "ckpt-tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_alt_ckpt(shared_dir) -> Path:
    return _checkpoint(shared_dir, "ckpt-tiny-alt", "tiny-alt", seed=0)


_PIPES: dict = {}


def diffusers_image(root: Path, prompt: str, negative_prompt: str | None = " ", guidance: float = 4.0,
                    seed: int = 0, steps: int = 6, height: int = TINY_RES[0], width: int = TINY_RES[1]):
    """The reference: diffusers' QwenImagePipeline on the same checkpoint and settings."""
    from diffusers import QwenImagePipeline
    if root not in _PIPES:
        pipe = QwenImagePipeline.from_pretrained(str(root), torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[root] = pipe
    out = _PIPES[root](prompt, negative_prompt=negative_prompt, true_cfg_scale=guidance, num_inference_steps=steps,
                       height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed))
    return out.images[0]


@pytest.fixture(scope="session")
def bundle(shared_dir, cache_dir, tiny_ckpt) -> Path:
    """The embedded model at one resolution and two text buckets, built through the CLI."""
    return _build(shared_dir, "bundle", "--model", tiny_ckpt, "--cache-dir", cache_dir,
                  "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", ",".join(map(str, BUCKETS)))[0]


def _export_args(tiny_ckpt, cache_dir) -> list:
    return ["--model", tiny_ckpt, "--cache-dir", cache_dir, "--backend", "export", "--resolution",
            "{}x{}".format(*TINY_RES), "--text-buckets", ",".join(map(str, BUCKETS))]


@pytest.fixture(scope="session")
def bundle_export(shared_dir, cache_dir, tiny_ckpt) -> Path:
    """The session bundle's build with the export back end (torch.export programs run by torch, nothing
    compiled): the uncached image of tests/test_step_cache.py's export split bundle, bit for bit."""
    return _build(shared_dir, "bundle-one-res-export", *_export_args(tiny_ckpt, cache_dir))[0]


@pytest.fixture(scope="session")
def bundle_two_res(bundle_export, shared_dir, cache_dir, tiny_ckpt):
    """bundle_export's build with a second resolution added: (that bundle's path, the second build's stdout). What
    its tests check is the build's reuse and the host program at another size; each kind of graph is compiled in
    `bundle`."""
    return _build(shared_dir, "bundle-two-res", *_export_args(tiny_ckpt, cache_dir), "--resolution",
                  "{}x{}".format(*SECOND_RES))


@pytest.fixture(scope="session")
def bundle_exact(bundle, shared_dir, cache_dir, tiny_ckpt) -> Path:
    """Exact-length text (dynamic text dimension) instead of buckets."""
    return _build(shared_dir, "bundle-exact", "--model", tiny_ckpt, "--cache-dir", cache_dir,
                  "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "0")[0]


@pytest.fixture(scope="session")
def bundle_tp2(bundle, shared_dir, cache_dir, tiny_ckpt) -> Path:
    """The embedded model built with --tp 2 (one resolution, one bucket); the VAE graph is shared."""
    return _build(shared_dir, "bundle-tp2", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--tp", "2",
                  "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "72,")[0]


@pytest.fixture(scope="session")
def bundle_batch2(shared_dir, cache_dir, tiny_ckpt) -> Path:
    """One resolution, bucket 128, batch sizes 1 and 2: the batch-1 graphs are the session bundle's
    (cache hits), so only the three @B2 graphs compile."""
    return _build(shared_dir, "bundle-batch2", "--model", tiny_ckpt, "--cache-dir", cache_dir,
                  "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "128,", "--batch-sizes", "1,2")[0]


# ---- Qwen-Image-2.1 (tests/qwen_image_21_checkpoint.py: diffusers' and transformers' own classes) ---------

Q21_SIZE, Q21_BUCKET = (64, 64), 64     # one resolution, one text bucket (the 2.1 template is about 30 tokens)


@pytest.fixture(scope="session")
def q21_ckpt(shared_dir) -> Path:
    from tests.qwen_image_21_checkpoint import write_checkpoint
    return Path(made_once(shared_dir, "ckpt-q21", lambda out: str(write_checkpoint(out))))


def _q21_build(shared_dir: Path, cache_dir: Path, ckpt: Path, name: str, *args) -> Path:
    return _build(shared_dir, name, "--model", ckpt, "--cache-dir", cache_dir, "--resolution",
                  "{}x{}".format(*Q21_SIZE), "--text-buckets", Q21_BUCKET, *args)[0]


@pytest.fixture(scope="session")
def q21_bundle(shared_dir, cache_dir, q21_ckpt) -> Path:
    """2.1 text to image at TP 1: text encoder, denoiser prefill and decode, VAE decoder."""
    return _q21_build(shared_dir, cache_dir, q21_ckpt, "bundle-q21")


@pytest.fixture(scope="session")
def q21_bundle_tp2(shared_dir, cache_dir, q21_ckpt) -> Path:
    """The same at --tp 2 (the text encoder and the denoiser sharded), built with the export back end: its tests are
    of the ranks (their K/V heads, the exchange, TP 2 = TP 1); 2.1's compiled graphs are q21_bundle's, compiled TP
    is bundle_tp2's (tests/test_tp.py), and 2.1 at TP 2 is lowered in tests/test_neuron_xla_q21.py."""
    return _q21_build(shared_dir, cache_dir, q21_ckpt, "bundle-q21-tp2", "--tp", 2, "--backend", "export")


@pytest.fixture(scope="session")
def q21_bundle_cfgp(q21_bundle, shared_dir, cache_dir, q21_ckpt) -> Path:
    """--cfg-parallel at TP 1 (world 2): the same graphs as the TP 1 bundle's (no collective in them), cache hits."""
    return _q21_build(shared_dir, cache_dir, q21_ckpt, "bundle-q21-cfgp", "--cfg-parallel")


@pytest.fixture(scope="session")
def q21_pipe(q21_ckpt):
    """diffusers' QwenImage21Pipeline on the session's 2.1 checkpoint (fp32, CPU)."""
    from tests.qwen_image_21_checkpoint import load_pipeline
    return load_pipeline(q21_ckpt)


# ---- the trained shapes model (issue 20) ---------------------------------------------------------------

SHAPES_RES = (128, 128)
# `make edit`'s build and edit, read from the Makefile so the tests and the target cannot drift apart.
_MAKEFILE = (ROOT / "Makefile").read_text()
MAKE_EDIT_BUILD = re.search(r"qic build (--model embedded:shapes-edit[^\n]*?) \\\n", _MAKEFILE)[1].split()
MAKE_EDIT = re.search(r"^EDIT \?= (.+)$", _MAKEFILE, re.M)[1].strip()


@pytest.fixture(scope="session")
def shapes_ckpt(shared_dir) -> Path:
    return _checkpoint(shared_dir, "ckpt-shapes", "shapes")


@pytest.fixture(scope="session")
def shapes_bundle(shared_dir, cache_dir) -> Path:
    """The default model (`qic build` naming none: embedded:shapes) at the resolution `make run` draws at, so
    tests/test_install.py's builds are cache hits: the trained model's graphs compiled once. Its other two
    resolutions give graphs of the same kinds (keys that differ in a resolution only), drawn through
    shapes_bundle_export."""
    return _build(shared_dir, "bundle-shapes", "--cache-dir", cache_dir, "--resolution",
                  "{}x{}".format(*SHAPES_RES))[0]


@pytest.fixture(scope="session")
def shapes_bundle_export(shared_dir, cache_dir) -> Path:
    """The default build exactly (embedded:shapes at its three resolutions) with the export back end (torch runs
    the exported programs): the meaning and parity checks at the resolutions shapes_bundle does not compile."""
    return _build(shared_dir, "bundle-shapes-export", "--cache-dir", cache_dir, "--backend", "export")[0]


@pytest.fixture(scope="session")
def shapes_edit_bundle(shared_dir, cache_dir) -> Path:
    """`make edit`'s build exactly (the trained edit model at 128x128, condition size 128x128), so
    tests/test_install.py's edit build is a cache hit; its decoder is shapes_bundle's graph (the same VAE)."""
    return _build(shared_dir, "bundle-shapes-edit", "--cache-dir", cache_dir, *MAKE_EDIT_BUILD)[0]


@pytest.fixture(scope="session")
def shapes_bundle_batch2(shared_dir, cache_dir) -> Path:
    """The trained model at 128x128 with batch sizes 1 and 2, and step caching's split graphs for cache-dit's
    DBCache with Fn 2, Bn 1 (tests/test_step_cache.py), built with the export back end: its tests are of the host
    program (DBCache's decisions, batches through qic serve), and the compiled batch-2 and split graphs are
    bundle_batch2's and tests/test_compiled_layouts.py's TP 2 x CFG-parallel 2 bundle's (the compile of 7 graphs at
    128x128 saved)."""
    return _build(shared_dir, "bundle-shapes-batch2", "--cache-dir", cache_dir, "--backend", "export",
                  "--resolution", "{}x{}".format(*SHAPES_RES), "--batch-sizes", "1,2", "--step-cache", "2,1")[0]


@pytest.fixture(scope="session")
def fake_libnrt(tmp_path_factory) -> Path:
    """A FAKE libnrt (tests/fakes/fake_libnrt.c, built with gcc): records the calls qic's NEFF loader
    makes; it is not the Neuron runtime and runs no NEFF."""
    import shutil
    if not shutil.which("gcc"):
        pytest.fail("gcc is needed to build the fake libnrt")
    out = tmp_path_factory.mktemp("fake-libnrt") / "libnrt_fake.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(ROOT / "tests" / "fakes" / "fake_libnrt.c")],
                   check=True)
    return out
