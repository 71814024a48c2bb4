"""Issue 21: step caching. The step split in head / middle / tail graphs (qic/models/qwen_image/step_cache.py), the
decisions of diffusers' FirstBlockCache and cache-dit's DBCache (qic/host/cache_policy.py), through
`qic build --step-cache`, `qic run --cache-*`, `qic serve` batches, TP and the neuron lowering.

Bounds: a computed step through the split graphs is the whole step's arithmetic in the same order (the
tail adds a zero residual, exact), so split vs whole is held to torch.equal eagerly; compiled graphs and
diffusers differ from each other by fp32 reordering only, so the images are held to the suite's 2/255
(mean <= 0.02 of a level, tests/helpers.py) like every qic-vs-diffusers check. Decisions are compared
exactly: the thresholds chosen sit well clear of every step's figure (the figures are printed).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.step_cache import dbcache_reference, diffusers_pipe, fbc_reference
from qic.checkpoint.presets import preset
from tests.conftest import QIC, ROOT, SHAPES_RES, SHORT_PROMPT, TINY_RES, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL
from training import shapes

pytestmark = pytest.mark.slow   # builds and compiles step-cached bundles

STEPS = 10
PROMPT_SHAPES = shapes.prompt_of(*shapes.HELD_OUT[0])


# ------------------------------------------------------------------------------------------ helpers

@pytest.fixture(scope="module")
def tiny_pipe(tiny_ckpt):
    return diffusers_pipe(tiny_ckpt)


@pytest.fixture(scope="module")
def shapes_pipe(shapes_ckpt):
    return diffusers_pipe(shapes_ckpt)


_RUNS: dict = {}


def _qic_run(bundle, tmp_path, name, *flags, prompt=SHORT_PROMPT, steps=STEPS, seed=0):
    """`qic run --verbose` -> (the PNG, stdout); a run of the same bundle and arguments is made once (the tests of
    one module run on one xdist worker)."""
    key = (str(bundle), prompt, steps, seed, tuple(map(str, flags)))
    if key not in _RUNS:
        out = tmp_path / f"{name}.png"
        proc = qic("run", bundle, "--prompt", prompt, "--steps", steps, "--seed", seed, "--output", out, "--verbose",
                   *flags)
        image = Image.open(out)
        image.load()
        _RUNS[key] = image, proc.stdout
    image, stdout = _RUNS[key]
    return image, stdout


def _computed(image) -> dict:
    """The PNG's step_cache chunk -> {"cond": [...], "uncond": [...]}."""
    from qic.host.cache_policy import parse_steps
    text = image.text["step_cache"].split("computed: ", 1)[1]
    out = {}
    for part in text.split("), "):
        name, rest = part.split(" ", 1)
        out[name] = list(parse_steps(rest.split("(", 1)[1].rstrip(")")))
    return out


def _some_cached(computed: dict, steps: int) -> bool:
    """Some row computed more than its first step and cached others: decisions that a comparison can tell apart
    (every step computed, or all but the first cached, is what a broken figure or threshold gives too)."""
    return any(1 < len(c) < steps for c in computed.values())


# ------------------------------------------------------------------------------------------ bundles

@pytest.fixture(scope="module")
def fbc_bundle(bundle_export, workdir, cache_dir, tiny_ckpt):
    """The tiny random checkpoint (3 blocks) with FirstBlockCache's split (1, 0), built with the export back end:
    the text encoder, whole step and decoder are bundle_export's (cache hits), four split graphs are new. The tests
    here are of the host program's decisions and images against diffusers'; the split graphs compiled by inductor
    are tests/test_compiled_layouts.py's TP 2 x CFG-parallel 2 bundle's, held to diffusers' FirstBlockCache there."""
    out = workdir / "bundle-step-cache-fbc"
    qic("build", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--output", out, "--resolution",
        "{}x{}".format(*TINY_RES), "--text-buckets", "72", "--step-cache", "1,0", "--backend", "export")
    return out


# ------------------------------------------------------------------------------------------ the split

def test_split_parts_are_the_whole_step():
    """Eager, looped and unrolled: head -> mid -> tail with every row computed equals the whole-step graph
    bit for bit, and so does head -> rest (the middle and the tail in one graph), whose residuals are the
    middle's bit for bit; the cached path fed this step's own residuals equals it to fp32 rounding."""
    from qic.models.common import load_weights
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image.graphs import denoiser_graph, step_part_graph
    from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT
    from tests.helpers import mmdit_bound, rel_l2, sensitize_
    p = preset("tiny")["transformer"] | {"num_layers": 4}
    config = MMDiTConfig.from_dict(p)
    ref = sensitize_(QwenMMDiT(config)).eval()
    looped = LoopedMMDiT(config).eval()
    load_weights(looped, stack_block_weights(ref.state_dict(), "transformer_blocks", 4), "transformer")
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 15, config.in_channels, generator=g)
    txt = torch.randn(2, 30, config.joint_attention_dim, generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, 10:] = 0
    scalars = torch.tensor(700.0), torch.tensor(0.7), torch.tensor(0.6), torch.tensor(4.0)
    for model in (ref, looped):
        with torch.no_grad():
            want = denoiser_graph(model, config, 8, *TINY_RES, 64, "float32").module(lat, txt, mask, *scalars)
            for first, last in ((1, 0), (2, 1), (1, 2)):
                def part(name, **kw):
                    return step_part_graph(model, config, 8, *TINY_RES, 64, "float32", name, first, last, **kw).module
                img, tx, temb, res, diff = part("head")(lat, txt, mask, scalars[0], torch.ones(2, 15, config.inner_dim))
                o_img, o_txt, r_img, r_txt = part("mid")(img, tx, temb, mask)
                text = [mask, o_txt, torch.zeros_like(r_txt)] if last else []
                got = part("tail")(lat, o_img, torch.zeros_like(r_img), temb, *scalars[1:], *text)
                assert torch.equal(got, want), (type(model).__name__, first, last)
                rest = part("rest")(img, tx, temb, mask, lat, *scalars[1:])
                assert torch.equal(rest[0], want) and torch.equal(rest[1], r_img) and torch.equal(rest[2], r_txt)
                text = [mask, tx, r_txt] if last else []
                cached = part("tail")(lat, img, r_img, temb, *scalars[1:], *text)
                assert rel_l2(cached, want) <= mmdit_bound("tiny")
                # One row alone through the one-row middle: the same residuals as in the batch of two.
                one = part("mid", rows=1)(img[1:], tx[1:], temb[1:], mask[1:])
                assert rel_l2(one[2], r_img[1:]) <= mmdit_bound("tiny")
                # Row 1 computing and row 0 cached on this step's own residual, in one graph (mixed) and in two
                # (that one-row middle, then the tail): the same arithmetic, bit for bit.
                stored_txt = [r_txt] if last else []
                mixed = part("mixed", rows=1)(img, tx, temb, mask, lat, r_img, torch.tensor([1]), *scalars[1:],
                                              *stored_txt)
                text = [mask, torch.cat([tx[:1], one[1]]), torch.cat([r_txt[:1], torch.zeros_like(one[3])])]
                base, res = torch.cat([img[:1], one[0]]), torch.cat([r_img[:1], torch.zeros_like(one[2])])
                three = part("tail")(lat, base, res, temb, *scalars[1:], *(text if last else []))
                assert torch.equal(mixed[0], three)
                assert torch.equal(mixed[1], one[2]) and torch.equal(mixed[2], one[3])
                assert rel_l2(mixed[0], want) <= mmdit_bound("tiny")
                # and can fail: row 0 cached on no residual (its middle skipped) is far off
                skipped_row = part("mixed", rows=1)(img, tx, temb, mask, lat, torch.zeros_like(r_img),
                                                    torch.tensor([1]), *scalars[1:], *stored_txt)[0]
                assert rel_l2(skipped_row, want) > 100 * mmdit_bound("tiny")
    # The check can fail: a split that skips a block (first + last over the wrong range) is far off.
    with torch.no_grad():
        head = step_part_graph(ref, config, 8, *TINY_RES, 64, "float32", "head", 1, 0).module
        img, tx, temb, *_ = head(lat, txt, mask, scalars[0], torch.ones(2, 15, config.inner_dim))
        tail = step_part_graph(ref, config, 8, *TINY_RES, 64, "float32", "tail", 1, 0).module
        skipped = tail(lat, img, torch.zeros_like(img), temb, *scalars[1:])
        # and a rest that starts its middle a block late (the head's last block skipped) is far off too
        late = step_part_graph(ref, config, 8, *TINY_RES, 64, "float32", "rest", 2, 0).module
        late_out = late(img, tx, temb, mask, lat, *scalars[1:])[0]
    assert rel_l2(skipped, want) > 100 * mmdit_bound("tiny")
    assert rel_l2(late_out, want) > 100 * mmdit_bound("tiny")


# ------------------------------------------------------------------------------------------ FirstBlockCache

@pytest.mark.parametrize("threshold", [1.1, 1.2])
def test_first_block_cache_matches_diffusers_on_random_weights(fbc_bundle, tiny_pipe, tmp_path, threshold):
    ref, ref_computed = fbc_reference(tiny_pipe, threshold, SHORT_PROMPT, STEPS, *TINY_RES)
    image, out = _qic_run(fbc_bundle, tmp_path, "fbc", "--cache-threshold", threshold)
    got = _computed(image)
    print(out.strip().splitlines()[-1], "| diffusers:", ref_computed)
    assert got == ref_computed
    assert _some_cached(got, STEPS), got
    worst, mean = image_diff(image, ref)
    print(f"threshold {threshold}: qic vs diffusers' cached image max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    # The bound can fail: the uncached image is far from the cached one.
    uncached, _ = _qic_run(fbc_bundle, tmp_path, "plain")
    assert image_diff(uncached, ref)[0] > 2


def test_threshold_zero_is_the_uncached_image_and_a_mask_replays_decisions(fbc_bundle, bundle_export, tmp_path):
    """--cache-threshold 0 runs the whole-step graph: the image of a bundle without step caching (of the same
    back end), exactly. A static mask of the steps a threshold run computed gives that run's image exactly (no
    figure read)."""
    plain, _ = _qic_run(bundle_export, tmp_path, "bundle")
    zero, _ = _qic_run(fbc_bundle, tmp_path, "zero", "--cache-threshold", 0)
    assert np.array_equal(np.asarray(plain), np.asarray(zero))
    assert "step_cache" not in zero.text
    cached, _ = _qic_run(fbc_bundle, tmp_path, "thr", "--cache-threshold", 1.2)   # both branches alike here
    steps = _computed(cached)
    assert steps["cond"] == steps["uncond"]
    mask = ",".join(map(str, steps["cond"]))
    masked, _ = _qic_run(fbc_bundle, tmp_path, "mask", "--cache-steps", mask)
    assert _computed(masked) == steps
    assert np.array_equal(np.asarray(masked), np.asarray(cached))


def test_inspect_names_the_split_and_lists_its_graphs(fbc_bundle, bundle):
    """`qic inspect`'s step-caching line says the split the bundle was built with, and the graphs table holds the
    four split graphs (head, rest, mixed@R1, tail) beside the whole step; a bundle built without --step-cache has
    neither."""
    def inspect(path) -> tuple[str, set[str]]:   # (its text, the graphs table's first column), unwrapped
        out = qic("inspect", path, env={"COLUMNS": "300"}).stdout
        return out, {line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")}

    out, graphs = inspect(fbc_bundle)
    assert "step caching: split graphs, first 1 and last 0 blocks always computed" in out, out
    step = "denoiser@{}x{}@L72".format(*TINY_RES)
    assert {step, f"{step}@head", f"{step}@rest", f"{step}@mixed@R1", f"{step}@tail"} <= graphs, graphs
    # the all-rows middle runs inside @rest, the one-row middle inside @mixed (two rows: one computes at most)
    assert f"{step}@mid" not in graphs and f"{step}@mid@R1" not in graphs, graphs
    plain, graphs = inspect(bundle)
    assert "step caching" not in plain and not any(f"@{p}" in g for p in ("head", "rest", "mid", "tail")
                                                   for g in graphs)
    assert graphs   # the table was read


def test_first_block_cache_matches_diffusers_on_the_trained_model(shapes_bundle_export, workdir, cache_dir,
                                                                  shapes_pipe, tmp_path):
    """The trained model (4 blocks) with FirstBlockCache's split, 20 steps: the host program's decisions against
    diffusers'. Built with the export back end (nothing compiled; the whole step, text encoder and decoder are
    shapes_bundle_export's): the compiled split graphs are tests/test_compiled_layouts.py's."""
    out = workdir / "bundle-shapes-fbc"
    qic("build", "--cache-dir", cache_dir, "--output", out, "--resolution", "{}x{}".format(*SHAPES_RES),
        "--step-cache", "1,0", "--backend", "export")
    threshold, steps = 0.3, 20
    ref, ref_computed = fbc_reference(shapes_pipe, threshold, PROMPT_SHAPES, steps, *SHAPES_RES)
    image, _ = _qic_run(out, tmp_path, "fbc-shapes", "--cache-threshold", threshold, prompt=PROMPT_SHAPES,
                        steps=steps)
    got = _computed(image)
    print("qic:", got, "diffusers:", ref_computed)
    assert got == ref_computed and _some_cached(got, steps)
    worst, mean = image_diff(image.convert("RGB"), ref)
    print(f"trained model, FirstBlockCache {threshold}: max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    drawn = np.asarray(image.convert("RGB"))
    assert shapes.means(drawn, PROMPT_SHAPES), shapes.read_image(drawn)


# ------------------------------------------------------------------------------------------ DBCache

@pytest.mark.parametrize("limits", [{}, {"max_continuous": 2}, {"max_cached": 2}],
                         ids=["threshold", "max-continuous", "max-cached"])
def test_dbcache_matches_cache_dit(shapes_bundle_batch2, shapes_pipe, tmp_path, limits):
    """cache-dit's DBCache with Fn 2, Bn 1 on the trained 4-block model: the compiled split graphs. With a limit
    (--cache-max-continuous, --cache-max-cached: cache-dit's max_continuous_cached_steps, max_cached_steps), qic's
    steps are cache-dit's and not those of the same run without the limit: the limit decided some steps."""
    threshold, warmup, steps = 0.3, 2, 12
    ref, ref_computed = dbcache_reference(
        shapes_pipe, steps, PROMPT_SHAPES, *SHAPES_RES, Fn_compute_blocks=2, Bn_compute_blocks=1,
        residual_diff_threshold=threshold, max_warmup_steps=warmup,
        max_continuous_cached_steps=limits.get("max_continuous", -1), max_cached_steps=limits.get("max_cached", -1))
    flags = ["--cache-threshold", threshold, "--cache-warmup", warmup]
    limit_flags = [x for key, value in limits.items() for x in ("--cache-" + key.replace("_", "-"), value)]
    image, out = _dbcache_run(shapes_bundle_batch2, tmp_path, *flags, *limit_flags, steps=steps)
    got = _computed(image)
    print(out.strip().splitlines()[-1], "| cache-dit:", ref_computed)
    assert got == ref_computed and 0 < len(got["cond"]) < steps
    worst, mean = image_diff(image.convert("RGB"), ref)
    print(f"DBCache F2B1 {limits}: qic vs cache-dit max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    if limits:
        free, _ = _dbcache_run(shapes_bundle_batch2, tmp_path, *flags, steps=steps)   # the threshold case's run
        print("without the limit:", _computed(free))
        assert _computed(free) != got


_DBCACHE_RUNS: dict = {}


def _dbcache_run(bundle, tmp_path, *flags, steps):
    """`qic run` of the trained model with these step-caching flags, once per module: the limited cases compare
    with the unlimited case's run, which the first case already made."""
    key = tuple(map(str, flags)) + (steps,)
    if key not in _DBCACHE_RUNS:
        _DBCACHE_RUNS[key] = _qic_run(bundle, tmp_path, f"dbc-{len(_DBCACHE_RUNS)}", *flags, prompt=PROMPT_SHAPES,
                                      steps=steps)
    return _DBCACHE_RUNS[key]


def test_a_batch_of_two_through_qic_serve_decides_per_image(shapes_bundle_batch2, tmp_path):
    """Two images of one request (a batch of 2) get the pixels and decisions each gets alone."""
    import base64
    import io

    from openai import OpenAI

    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    from tests.test_serve import ServeProcess
    settings = {"cache_threshold": 0.3, "cache_warmup": 1}
    log = tmp_path / "serve.log"
    srv = ServeProcess(shapes_bundle_batch2, log, "--queue", 4, "--max-n", 2)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        resp = client.images.generate(prompt=PROMPT_SHAPES, n=2, size="128x128", response_format="b64_json",
                                      extra_body={"seed": 4, "steps": 12, **settings})
        served = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in resp.data]
    finally:
        srv.close()
    bundle = Bundle(shapes_bundle_batch2)
    for i, image in enumerate(served):
        alone = generate(bundle, Request(PROMPT_SHAPES, steps=12, seed=4 + i, height=128, width=128, **settings))
        assert _computed(image) == dict(zip(("cond", "uncond"), alone.computed))
        worst, _ = image_diff(image.convert("RGB"), alone.image)
        assert worst <= 1, worst   # batch-2 vs batch-1 graphs: reordered fp32 sums only
    assert _computed(served[0]) != _computed(served[1]) or not np.array_equal(np.asarray(served[0]),
                                                                             np.asarray(served[1]))
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")
               and '"step_cache"' in line]
    assert records and len(records[-1]["step_cache"]) == 2


# ------------------------------------------------------------------------------------------ neuron, TP

@pytest.mark.parametrize("tp", [1, 2])
def test_split_graphs_lower_and_run_on_xla_cpu(tp):
    """Each split graph of a 4-block denoiser lowered at TP=tp and run on tp XLA:CPU devices, against TP 1 eager on
    the same weights: the outputs that are not an input passed through (benchmarks/xla_lowering.py CHECKED: the
    head's five, the middle's residuals, the tail's prediction, the rest's and the mixed graph's both), in rel-L2
    and in max-abs over the output's largest magnitude. Both are fp32 reorderings of the same sums (XLA's fusion
    and blocking, the TP split), so both are held to the reordering bound of this model's sums (tests/helpers.py);
    a dropped text mask, or at TP 2 rank 0 holding rank 1's shard, moves them by a hundred times that."""
    from tests.helpers import fp32_reorder_bound
    from tests.test_neuron_xla import xla
    proc = xla("-m", "benchmarks.xla_lowering", "step-cache", tp, env={"CPU_NUM_DEVICES": str(tp)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result) == sorted(f"denoiser@48x80@L128@{p}" for p in ("head", "rest", "mixed@R1", "mid@R1", "tail"))
    c = preset("tiny")["transformer"]
    bound = fp32_reorder_bound(4 * c["num_attention_heads"] * c["attention_head_dim"], 8 * 4 + 4)   # 4 blocks
    for name, r in result.items():
        print(name, {k: v for k, v in r.items() if k in ("cos", "checked")})
        # one loop a block range: the rest and the mixed graph run two (the middle's blocks, then the tail's)
        two_loops = name.endswith(("@rest", "@mixed@R1"))
        assert r["host_transfers"] == 0 and r["while"] == (2 if two_loops else 1)
        assert len(r["checked"]) == tp
        for rank in r["checked"]:
            for output, e in rank.items():
                assert e["rel_l2"] <= bound and e["max_abs"] <= bound * e["scale"], (name, output, e, bound)
        for broken in ("mask_dropped", "wrong_shard") if tp > 1 else ("mask_dropped",):
            worst = max(e["rel_l2"] for e in r[broken][0].values())
            assert worst > 100 * bound, (name, broken, worst)
        if tp > 1:
            assert r["replica_groups"] == [json.dumps([list(range(tp))])]
            # Per block four all-reduces (both streams' attention and MLP outputs) over the 4-block model's
            # split 1 | 2 | 1 (each loop body holds them once: the rest and the mixed graph have two loops), plus the
            # head's timestep embedder: the decision's means add none (the image stream is whole on every rank).
            assert r["all_reduce"] == (5 if name.endswith("@head") else 8 if two_loops else 4)
        else:
            assert r["all_reduce"] == 0


@pytest.fixture(scope="module")
def fbc_bundle_tp2(workdir, cache_dir, tiny_ckpt):
    """fbc_bundle's split at TP 2, built with the export back end: the test is of the ranks' decisions (rank 0's,
    broadcast); compiled split graphs at TP 2 are tests/test_compiled_layouts.py's TP 2 x CFG-parallel 2 bundle's."""
    out = workdir / "bundle-step-cache-tp2"
    qic("build", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--output", out, "--tp", "2", "--resolution",
        "{}x{}".format(*TINY_RES), "--text-buckets", "128,", "--step-cache", "1,0", "--backend", "export")
    return out


def test_tp2_decides_and_draws_as_tp1(fbc_bundle, fbc_bundle_tp2, tmp_path):
    """The split graphs at TP 2 (two spawned ranks, gloo on loopback; rank 0's decisions broadcast): the TP 1
    bundle's decisions, and its image within the bound (TP's split sums reorder fp32 only)."""
    tp2, _ = _qic_run(fbc_bundle_tp2, tmp_path, "tp2", "--cache-threshold", 1.1, "--tp", 2)
    tp1, _ = _qic_run(fbc_bundle, tmp_path, "tp1", "--cache-threshold", 1.1)
    assert _computed(tp2) == _computed(tp1) and _some_cached(_computed(tp1), STEPS), _computed(tp1)
    worst, mean = image_diff(tp2, tp1)
    print(f"TP 2 vs TP 1, threshold 1.1: max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)


def test_tp2_rank_killed_mid_loop_is_one_line_naming_it(fbc_bundle_tp2, tmp_path):
    """Issue 29: `qic run --tp 2` with step caching, rank 1 SIGKILLed (the OOM killer) in the second prompt's
    loop: rank 0 fails within the collective timeout, and qic run exits 2 with one error line naming rank 1."""
    import psutil

    from qic.parallel.ranks import DEFAULT_TIMEOUT, REPORT_GRACE_S
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": SHORT_PROMPT, "seed": i, "output": str(tmp_path / f"{i}.png")})
                               + "\n" for i in range(20)))
    proc = subprocess.Popen([*QIC, "run", str(fbc_bundle_tp2), "--tp", "2", "--prompts-file", str(prompts), "--steps",
                             str(STEPS), "--cache-threshold", "1.1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(tmp_path.glob("*.png")):   # the first image is out: the ranks are in the second's loop
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        ranks = sorted((k for k in psutil.Process(proc.pid).children() if "resource_tracker" not in
                        " ".join(k.cmdline())), key=lambda k: (k.create_time(), k.pid))   # started in rank order
        ranks[1].kill()
        t = time.monotonic()
        _, err = proc.communicate(timeout=DEFAULT_TIMEOUT.total_seconds() + REPORT_GRACE_S + 30)
        seconds = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(f"rank 1 killed: qic run exited {proc.returncode} {seconds:.2f} s later; stderr: {err!r}")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: tensor-parallel run failed: rank 1: exited with code -9 (SIGKILL)"), err
    # nothing but that line: the peer's C++ warnings about the closed connection stay in the ranks' stderr files
    assert [line for line in err.splitlines() if line.strip()] == errors, err
    assert seconds < DEFAULT_TIMEOUT.total_seconds() + REPORT_GRACE_S


def test_neuron_bundle_with_step_caching_runs_on_xla_cpu_like_torch(fbc_bundle, workdir, neuron_cache, tiny_ckpt,
                                                                   tmp_path):
    """`qic build --backend neuron --step-cache 1,0`: every split graph lowered and checked on XLA:CPU at build
    time (the manifest's figures), then run with --device xla-cpu: the decisions and image of the export bundle
    (the same exported graphs run by torch)."""
    from tests.test_neuron_xla import XLA_CPU_REL_L2, xla_qic
    out = workdir / "bundle-neuron-step-cache"
    xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", neuron_cache,
            "--output", out, "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "72", "--step-cache", "1,0")
    graphs = json.loads((out / "manifest.json").read_text())["graphs"]
    parts = [g for g in graphs if any(f"@{p}" in g["name"] for p in ("head", "rest", "mixed", "mid", "tail"))]
    assert len(parts) == 4 and all(0 <= g["checks"]["xla_cpu_rel_l2"] <= XLA_CPU_REL_L2 for g in parts), parts
    flags = ["--prompt", SHORT_PROMPT, "--steps", STEPS, "--cache-threshold", 1.2]
    xla_qic("run", out, "--device", "xla-cpu", *flags, "--output", tmp_path / "xla.png")
    xla_image = Image.open(tmp_path / "xla.png")
    torch_image, _ = _qic_run(fbc_bundle, tmp_path, "export", "--cache-threshold", 1.2)
    assert _computed(xla_image) == _computed(torch_image)
    worst, mean = image_diff(xla_image, torch_image)
    print(f"xla-cpu vs export, threshold 1.2: max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)


# ------------------------------------------------------------------------------------------ bad input

def test_bad_step_cache_input_is_one_line(fbc_bundle, bundle, tiny_ckpt, tmp_path, cache_dir):
    cases = [
        (["run", bundle, "--prompt", "x", "--cache-threshold", "0.1"], "needs a bundle built with step_cache"),
        (["run", fbc_bundle, "--prompt", "x", "--cache-threshold", "-1"], "cache_threshold must be"),
        (["run", fbc_bundle, "--prompt", "x", "--steps", "4", "--cache-steps", "0-5"], "names step 5"),
        (["run", fbc_bundle, "--prompt", "x", "--cache-steps", "a-b"], "not a step index"),
        (["build", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--output", tmp_path / "b", "--step-cache", "2,1"],
         "leaves no middle block"),
        (["build", "--model", tiny_ckpt, "--output", tmp_path / "b", "--step-cache", "0,1"], "Fn >= 1"),
    ]
    for args, expected in cases:
        proc = qic(*args, check=False)
        assert proc.returncode != 0
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
        assert expected in proc.stderr and len(lines) <= 2, (args, proc.stderr)
    assert os.path.exists(fbc_bundle)
