"""Batched graphs (build config `batch_sizes`) and `generate_batch`, alone and behind `qic serve`.

Batch parity bound: each image of a batch is compared with the image `generate` makes for that request
alone. The graphs compute the same fp32 arithmetic per image, but a batch of n feeds n times the rows to
each matmul and attention kernel, which may block (and so sum) them differently: fp32 rounding-level
differences in the latents, which can move a pixel across a rounding boundary of the 8-bit output and
nowhere further. So: at most 1 level of 255 per pixel, and almost every pixel exact.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from qic.errors import ConfigError
from qic.spec import parse_spec
from tests.conftest import TINY_RES, image_diff, pixels, qic
from tests.helpers import rel_l2
from tests.test_mmdit import TOL, _inputs, models  # noqa: F401 (models: the eager tiny MMDiT fixture)
from tests.test_serve import ServeProcess

LEVEL = 1.0            # one 8-bit level: the bound (module docstring)
MEAN = 0.01            # mean |diff| in levels: a few flipped roundings among 3*48*80 values at most


def test_batch_sizes_key_is_validated_and_batch_1_graphs_keep_their_names():
    from qic.builder.jobs import graph_shapes, name_of
    for bad in ([0], "two", [1.5], [True], []):
        with pytest.raises(ConfigError, match="batch_sizes must be a list of positive integers"):
            parse_spec({"batch_sizes": bad})
    with pytest.raises(ConfigError, match="batch_sizes .* needs fixed text_buckets"):
        parse_spec({"batch_sizes": [2], "text_buckets": 0})
    assert parse_spec({"batch_sizes": "2"}).batch_sizes == (1, 2)   # batch 1 is always built
    plain = graph_shapes(parse_spec({"resolutions": ["48x80"], "text_buckets": 128}))
    both = graph_shapes(parse_spec({"resolutions": ["48x80"], "text_buckets": 128, "batch_sizes": [1, 2]}))
    assert [g for g in both if "batch" not in g[1]] == plain        # batch-1 shapes (spec keys) unchanged
    assert sorted(name_of(c, shape) for c, shape in both if "batch" in shape) == [
        "denoiser@48x80@L128@B2", "text_encoder@L128@B2", "vae_decoder@48x80@B2"]
    # Without text buckets: exact-length text where nothing needs fixed ones; a batched build keeps the bucket of 128
    assert parse_spec({}).text_buckets == (0,) and parse_spec({"batch_sizes": [1, 2]}).text_buckets == (128,)
    for fixed in ({"ulysses": 2, "tp": 2}, {"tp": 2}, {"cfg_parallel": True}, {"device": "cuda"},
                  {"backend": "neuron"}):
        assert parse_spec(fixed).text_buckets == (128,), fixed
    with pytest.raises(ConfigError, match="exact-length text .0. needs graphs with a dynamic text length; the neuron"):
        parse_spec({"backend": "neuron", "text_buckets": 0})


def test_denoise_step_batch_of_two_is_two_single_steps_and_pairs_rows(models):  # noqa: F811 (fixture)
    """Eager DenoiseStep: text rows [cond 0, cond 1, uncond 0, uncond 1], guidance [2]. A batch regroups
    fp32 sums (rows per matmul), so the bound is test_mmdit's summation-order TOL on the update."""
    from qic.models.qwen_image.mmdit import rope_tables
    from qic.models.qwen_image.step import DenoiseStep
    _, ours, config, grid = models
    latents, _ = _inputs(config, grid, 2, 5, seed=5)
    _, text = _inputs(config, grid, 4, 5, seed=6)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 4:], mask[2, 3:] = 0, 0           # padding differs per row
    cos, sin = rope_tables(config, *grid, 5)
    scalars = (torch.tensor(600.0), torch.tensor(0.6), torch.tensor(0.45))
    guidance = torch.tensor([2.5, 6.0])
    step, plain = DenoiseStep(ours), DenoiseStep(ours, cfg=False)

    def update(out, i):
        return out[i:i + 1] - latents[i:i + 1]

    with torch.no_grad():
        got = step(latents, text, mask, *scalars, guidance, cos, sin)
        got_plain = plain(latents, text[:2], mask[:2], *scalars, None, cos, sin)
        for i in (0, 1):
            rows = [i, 2 + i]
            alone = step(latents[i:i + 1], text[rows], mask[rows], *scalars, guidance[i], cos, sin)
            assert rel_l2(update(got, i), alone - latents[i:i + 1]) <= TOL
            alone = plain(latents[i:i + 1], text[i:i + 1], mask[i:i + 1], *scalars, None, cos, sin)
            assert rel_l2(update(got_plain, i), alone - latents[i:i + 1]) <= TOL
        # Wrong pairings break it: uncond rows swapped between the images, or their guidance scales.
        swapped = step(latents, text[[0, 1, 3, 2]], mask[[0, 1, 3, 2]], *scalars, guidance, cos, sin)
        assert rel_l2(update(swapped, 0), update(got, 0)) > 100 * TOL
        flipped = step(latents, text, mask, *scalars, guidance.flip(0), cos, sin)
        assert rel_l2(update(flipped, 0), update(got, 0)) > 100 * TOL


@pytest.fixture(scope="module")
def loaded(bundle_batch2):
    from qic.runtime.bundle import Bundle
    return Bundle(bundle_batch2)


def test_batched_images_equal_each_request_run_alone(loaded):
    from qic.runtime.generate import Request, generate, generate_batch
    assert loaded.manifest["batch_sizes"] == [1, 2]

    # CFG: same prompt and seed, different negative prompt and guidance, so only a right pairing of each
    # image with its own uncond row and scale can match (the cross comparison below shows it would fail).
    def cfg_pair():
        return [Request("a red bicycle", negative_prompt=" ", guidance=2.5, seed=1, steps=3),
                Request("a red bicycle", negative_prompt="blurry", guidance=6.0, seed=1, steps=3)]

    # No CFG (guidance 1: the CFG graph with guidance 1, this bundle has no no-CFG graph): other prompts, seeds.
    def plain_pair():
        return [Request("a cat", guidance=1.0, seed=3, steps=2), Request("a dog on the grass", guidance=1.0, seed=4,
                                                                          steps=2)]

    for make in (cfg_pair, plain_pair):
        batched = generate_batch(loaded, make())
        alone = [generate(loaded, r) for r in make()]
        for got, want in zip(batched, alone):
            worst, mean = image_diff(got.image, want.image)
            assert worst <= LEVEL and mean <= MEAN, (make.__name__, worst, mean)
        # A wrong pairing breaks the bound: each batched image against the other request's.
        assert image_diff(batched[0].image, alone[1].image)[0] > 10 * LEVEL
        assert image_diff(batched[1].image, alone[0].image)[0] > 10 * LEVEL


def test_generate_batch_refuses_incompatible_requests(loaded):
    from qic.runtime.generate import Request, generate_batch
    with pytest.raises(ConfigError, match="share resolution, text bucket, steps and CFG mode"):
        generate_batch(loaded, [Request("a cat", steps=2), Request("a cat", steps=3)])


def test_a_weight_set_batches_as_the_bundles_own_weights(loaded, bundle_batch2, cache_dir, tmp_path):
    """A checkpoint folder cut for the batched bundle (qic build --weights-for), mapped over its loaded code as qic
    serve maps a named set: a batch of two requests over the set equals each run alone over it, and neither is the
    bundle's own image."""
    from qic.checkpoint.embedded import write_checkpoint
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate, generate_batch
    ckpt = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1)
    qic("build", "--weights-for", bundle_batch2, "--model", ckpt, "--output", tmp_path / "set",
        "--cache-dir", cache_dir)
    mapped = Bundle(bundle_batch2, weights_from=tmp_path / "set", code_from=loaded)
    assert mapped.tokenizer is loaded.tokenizer   # mapped over the loaded bundle, not loaded again

    def pair():
        return [Request("a red bicycle", seed=1, steps=2, guidance=3.0),
                Request("a dog on the grass", seed=4, steps=2, guidance=5.0)]

    batched, own = generate_batch(mapped, pair()), generate_batch(loaded, pair())
    for got, want, theirs in zip(batched, [generate(mapped, r) for r in pair()], own):
        worst, mean = image_diff(got.image, want.image)
        assert worst <= LEVEL and mean <= MEAN, (worst, mean)
        assert image_diff(got.image, theirs.image)[0] > 10 * LEVEL   # the set's weights ran, not the bundle's


def test_server_batches_two_concurrent_requests_like_qic_run(bundle_batch2, tmp_path):
    from qic.serve.client import request
    size = "{1}x{0}".format(*TINY_RES)
    bodies = [{"prompt": "a red bicycle", "seed": 5, "steps": 2, "guidance": 3.0, "negative_prompt": "blurry"},
              {"prompt": "a blue car", "seed": 6, "steps": 2, "guidance": 5.0, "negative_prompt": " "}]
    srv = ServeProcess(bundle_batch2, tmp_path / "serve.log", "--max-batch", 2)
    try:
        out: dict = {}

        def post(name, body):
            out[name] = request(srv.port, "POST", "/v1/images/generations", {**body, "size": size}, timeout=120)

        # A longer request of other steps holds the runner, so the two compatible ones are both queued
        # when it frees (the queue groups only what is waiting; this makes them wait).
        blocker = threading.Thread(target=post, args=("blocker", {"prompt": "x", "seed": 9, "steps": 40}))
        blocker.start()
        time.sleep(0.1)
        pair = [threading.Thread(target=post, args=(i, b)) for i, b in enumerate(bodies)]
        for t in pair:
            t.start()
        for t in [blocker, *pair]:
            t.join(120)
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log_path.read_text()
    records = {r["seed"]: r for r in map(json.loads, filter(lambda s: s.startswith("{"),
                                                            srv.log_path.read_text().splitlines()))
               if r.get("path") == "/v1/images/generations"}
    assert [records[s]["batch"] for s in (9, 5, 6)] == [1, 2, 2], records
    served = []
    for i in range(2):
        status, _, body = out[i]
        assert status == 200, body
        served.append(base64.b64decode(body["data"][0]["b64_json"]))

    (tmp_path / "p.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bodies))
    qic("run", bundle_batch2, "--prompts-file", tmp_path / "p.jsonl", "--output", tmp_path / "img.png")
    written = [(tmp_path / f"img-{i:03d}.png").read_bytes() for i in range(2)]
    for got, want in zip(served, written):
        # Bytes can differ only where a pixel moved one level (module docstring); the metadata is the same.
        a, b = Image.open(io.BytesIO(got)), Image.open(io.BytesIO(want))
        assert a.text == b.text
        worst, mean = image_diff(a, b)
        assert worst <= LEVEL and mean <= MEAN, (worst, mean)
    assert np.abs(pixels(Image.open(io.BytesIO(served[0]))) - pixels(Image.open(io.BytesIO(written[1])))).max() > 10


def _cfgp_batch_rank(rank: int, world: int, path: str, prompts: list, seeds: list):
    """Rank `rank` of a CFG-parallel bundle: a batch of guidance-1 requests, its images and whether it idled."""
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate_batch
    bundle = Bundle(path, rank=rank, world=world)
    h, w = TINY_RES
    results = generate_batch(bundle, [Request(p, steps=4, seed=s, guidance=1.0, height=h, width=w)
                                      for p, s in zip(prompts, seeds)])
    return [pixels(r.image) for r in results], ["idle" in r.timings for r in results]


@pytest.mark.slow
def test_cfg_parallel_without_cfg_splits_a_batch_between_the_groups(tiny_ckpt, tmp_path):
    """Guidance 1 on a CFG-parallel bundle with the no-CFG graph and batch sizes 1, 2, without step caching: CFG group
    0 denoises the first image and group 1 the second (neither idles), through a built bundle and its loaded graphs
    (the eager runs of this split are tests/test_parallel_layouts.py's and, cached, test_step_cache_layouts.py's).
    Built with the export back end: the compiled CFG-parallel graphs are tests/test_compiled_layouts.py's. Each
    image is the one the eager TP 1 stand-in draws for its request alone: fp32 reordering only (tests/helpers.py)."""
    from qic.builder.eager import EagerModel
    from qic.parallel.tp import spawn
    from qic.runtime.generate import Request, generate
    from tests.helpers import MAX_PIXEL, MEAN_PIXEL
    out, config = tmp_path / "cfgp", tmp_path / "cfgp.yaml"
    config.write_text(json.dumps({"model": str(tiny_ckpt), "backend": "export", "cfg_parallel": True,
                                  "cfg": [True, False], "resolutions": ["{}x{}".format(*TINY_RES)],
                                  "text_buckets": [128], "batch_sizes": [1, 2], "cache_dir": str(tmp_path / "cache"),
                                  "output": str(out)}))
    qic("build", config)
    prompts, seeds = ["a red bicycle", "a blue sphere"], [3, 4]
    ranks = spawn(_cfgp_batch_rank, 2, str(out), prompts, seeds, timeout=600)
    eager = EagerModel(tiny_ckpt, [TINY_RES], [128])
    h, w = TINY_RES
    alone = [pixels(generate(eager, Request(p, steps=4, seed=s, guidance=1.0, height=h, width=w)).image)
             for p, s in zip(prompts, seeds)]
    for images, idled in ranks:
        assert not any(idled), "a CFG group idled with half a batch to denoise"
        for got, want in zip(images, alone):
            worst, mean = image_diff(got, want)
            print(f"CFG-parallel batch split vs alone: max {worst:.0f}/255, mean {mean:.4f}")
            assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    assert image_diff(ranks[0][0][0], ranks[0][0][1])[0] > 10 * MAX_PIXEL   # two images, not one twice
