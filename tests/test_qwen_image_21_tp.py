"""Qwen-Image-2.1 at TP 2 and CFG-parallel. `qic build --tp 2` shards the text encoder and the denoiser by their
own TP plans (the denoiser's is diffusers' QwenImage21Transformer2DModel._tp_plan: attention and SwiGLU colwise /
rowwise, the shared modulation replicated), `qic run` spawns two ranks (gloo, CPU), and the image is the TP 1
bundle's and the pipeline's. Each rank's resident prefix K/V holds its half of the heads.

The session's checkpoint and TP 1 bundle (tests/conftest.py q21_ckpt, q21_bundle) are reused: 6 heads a model
(3 a rank), so the same checkpoint serves both; only the TP 2 text encoder and denoiser graphs compile here.

Bounds: TP splits every row-parallel matmul into two partial sums and an all-reduce: the same sums in another
order, a relative error of a few fp32 ulps, far under one 8-bit level, so a pixel moves by at most one level
(where a value sits on a rounding boundary) and rarely (mean: tests/helpers.py MEAN_PIXEL). The prefix K/V, through
the text encoder's and the denoiser's layers, within the fp32 reordering bound of those reductions.

CFG-parallel (`--cfg-parallel`, world 2 at TP 1): each CFG group encodes and denoises its own branch and keeps its
prefix K/V; the host exchanges the two predictions a step. The same graphs and arithmetic as TP 1 (bit for bit
here; the TP bound allows for kernels whose blocking follows a rank's thread count).
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.conftest import Q21_BUCKET, Q21_SIZE, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL, DecodePrefix, fp32_reorder_bound, rel_l2

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

STEPS, SEED = 3, 7
PROMPT, NEGATIVE, GUIDANCE = "a red circle on a blue background", "a green square", 4.0
TP_MAX_PIXEL = 1    # module docstring: a reordering moves a pixel by at most one level
# K/V: the text encoder's 2 layers (about 7 reductions each, the embedding's all-reduce) and the denoiser's 2
# prefix blocks (about 8 each), plus the text projection; no sum longer than the SwiGLU's 3 x 96 = 288.
KV_TOL = fp32_reorder_bound(3 * 96, 7 * 2 + 8 * 2 + 4)


def _request(host, **kw):
    return host.Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE, seed=SEED, steps=STEPS, **kw)


def _prefix(host, b):
    """The request's cond-branch prefill from t = 1: its prefix K/V."""
    axes = b.manifest["denoiser"]["axes_dims_rope"]
    branch = host._branch(b, b.graph("text_encoder", bucket=Q21_BUCKET), host._ids(b, PROMPT), Q21_BUCKET,
                          (Q21_SIZE[0] // 16, Q21_SIZE[1] // 16), axes)
    latents = host.initial_noise(SEED, b.latents["z_dim"], *Q21_SIZE)
    prefill = b.graph("denoiser", Q21_SIZE, Q21_BUCKET, part="prefill")
    _, k, v = prefill(branch.text, latents, torch.ones(1), branch.index, branch.block_ids, branch.key_valid,
                      branch.cos, branch.sin)
    return k, v


def _peer_prefix(k, v):
    """The other rank's prefix K/V (its heads, not this rank's), exchanged on the host's group."""
    import torch.distributed as dist

    from qic.parallel.mesh import host_group
    peer = []
    for t in (k, v):
        both = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(both, t.contiguous(), group=host_group("world"))
        peer.append(both[1 - dist.get_rank()])
    return peer


def _rank(rank: int, world: int, bundle: str) -> dict:
    """One rank of the TP 2 bundle: the prefix K/V, images without the KV cache, and the broken variants."""
    from qic.models.qwen_image_21 import host
    from qic.runtime import bundle as loader
    b = loader.Bundle(bundle, rank=rank, world=world)
    k, v = _prefix(host, b)
    out = {"k": k, "v": v, "no_kv_cache": host.generate(b, _request(host, kv_cache=False)).image,
           "peer_prefix": host.generate(DecodePrefix(b, _peer_prefix), _request(host)).image}
    # Both ranks load rank 0's denoiser shard (a loader that ignores the rank): half the heads twice.
    real = loader.mmap_safetensors
    loader.mmap_safetensors = lambda p: real(p.parent / "rank0.safetensors" if "denoiser" in p.parts else p)
    try:
        out["rank0_shards"] = host.generate(loader.Bundle(bundle, rank=rank, world=world), _request(host)).image
    finally:
        loader.mmap_safetensors = real
    return out


def _diff(a, b, what: str) -> tuple[float, float]:
    mx, mean = image_diff(a, b)
    print(f"{what}: max {mx:.0f}/255, mean {mean:.4f}")
    return mx, mean


@pytest.fixture(scope="module")
def tp1(q21_bundle):
    """The TP 1 bundle's image (CFG, KV cache) and its prefix K/V."""
    from qic.models.qwen_image_21 import host
    from qic.runtime.bundle import Bundle
    b = Bundle(q21_bundle)
    return {"image": host.generate(b, _request(host)).image, "kv": _prefix(host, b),
            "no_kv_cache": host.generate(b, _request(host, kv_cache=False)).image}


@pytest.fixture(scope="module")
def ranks(q21_bundle_tp2):
    from qic.parallel.tp import spawn
    return spawn(_rank, 2, str(q21_bundle_tp2), timeout=600)


def test_tp2_bundle_holds_two_shards_of_the_sharded_components(q21_bundle_tp2):
    m = json.loads((q21_bundle_tp2 / "manifest.json").read_text())
    assert m["tp"] == 2
    weights = {g["component"]: g["weights"] for g in m["graphs"]}
    assert weights == {"text_encoder": ["weights/text_encoder/rank0.safetensors",
                                        "weights/text_encoder/rank1.safetensors"],
                       "denoiser": ["weights/denoiser/rank0.safetensors", "weights/denoiser/rank1.safetensors"],
                       "vae_decoder": ["weights/vae_decoder/rank0.safetensors"]}   # replicated: one file


def test_qic_run_tp2_draws_the_tp1_bundles_and_the_pipelines_image(q21_bundle_tp2, tp1, q21_pipe, tmp_path):
    png = tmp_path / "tp2.png"
    qic("run", q21_bundle_tp2, "--tp", 2, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE,
        "--seed", SEED, "--steps", STEPS, "--output", png)
    ours = Image.open(png)
    mx, mean = _diff(ours, tp1["image"], "TP 2 vs TP 1")
    assert mx <= TP_MAX_PIXEL and mean <= MEAN_PIXEL
    ref = q21_pipe(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE, height=Q21_SIZE[0], width=Q21_SIZE[1],
                   num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED)).images[0]
    mx, mean = _diff(ours, ref, "TP 2 vs diffusers")
    assert mx <= MAX_PIXEL and mean <= MEAN_PIXEL


def test_each_rank_holds_its_heads_of_the_prefix_kv(ranks, tp1, q21_ckpt):
    k1, v1 = tp1["kv"]
    heads = json.loads((q21_ckpt / "transformer" / "config.json").read_text())["num_attention_heads"]
    for r in ranks:   # [layers, 1, heads / 2, P, head_dim]: this rank's half of the heads
        assert r["k"].shape == r["v"].shape == (*k1.shape[:2], heads // 2, *k1.shape[3:])
    k2, v2 = (torch.cat([r[x] for r in ranks], 2) for x in ("k", "v"))   # rank order is head order
    print(f"prefix K/V TP 2 vs TP 1: rel-L2 {rel_l2(k2, k1):.1e}, {rel_l2(v2, v1):.1e} (bound {KV_TOL:.1e})")
    assert rel_l2(k2, k1) <= KV_TOL and rel_l2(v2, v1) <= KV_TOL
    swapped = torch.cat([ranks[1]["k"], ranks[0]["k"]], 2)   # the shards in the wrong order: not TP 1's
    assert rel_l2(swapped, k1) > 100 * KV_TOL


def test_tp2_without_the_kv_cache_is_tp1s(ranks, tp1):
    for r in ranks:
        mx, mean = _diff(r["no_kv_cache"], tp1["no_kv_cache"], "TP 2 no KV cache vs TP 1")
        assert mx <= TP_MAX_PIXEL and mean <= MEAN_PIXEL


@pytest.mark.parametrize("variant", ["peer_prefix", "rank0_shards"])
def test_broken_tp_variants_leave_the_bound(ranks, tp1, variant):
    """The decode attending to the other rank's prefix K/V (its heads), or both ranks on rank 0's denoiser shard:
    each is outside the bound the real run keeps."""
    mx, mean = _diff(ranks[0][variant], tp1["image"], f"broken {variant} vs TP 1")
    assert mean > MEAN_PIXEL and mx > MAX_PIXEL


# --------------------------------------------------------------------------------------------- CFG-parallel

def _cfg_rank(rank: int, world: int, bundle: str) -> dict:
    """One rank of the CFG-parallel bundle: the image, the prompts its text encoder saw, and a broken exchange
    (each group taking its own prediction for both branches)."""
    from qic.models.qwen_image_21 import host
    from qic.runtime.bundle import Bundle
    b = Bundle(bundle, rank=rank, world=world)
    seen = []

    class Counted:
        def __getattr__(self, name):
            return getattr(b, name)

        def graph(self, component, *args, **kw):
            g = b.graph(component, *args, **kw)
            if component != "text_encoder":
                return g
            return lambda ids, mask: seen.append(ids[0, :int(mask.sum())].tolist()) or g(ids, mask)

    out = {"image": host.generate(Counted(), _request(host)).image, "seen": seen,
           "ids": [host._ids(b, p) for p in (PROMPT, NEGATIVE)]}
    real = host.from_each_branch
    host.from_each_branch = lambda layout, x: [x] * layout.cfg
    try:
        out["own_only"] = host.generate(b, _request(host)).image
    finally:
        host.from_each_branch = real
    return out


def test_cfg_parallel_groups_run_one_branch_each_and_draw_tp1s_image(q21_bundle_cfgp, tp1):
    from qic.parallel.tp import spawn
    ranks = spawn(_cfg_rank, 2, str(q21_bundle_cfgp), timeout=600)
    for c, r in enumerate(ranks):
        assert r["seen"] == [r["ids"][c]]     # group c encoded branch c only (0 the prompt, 1 the negative)
        mx, mean = _diff(r["image"], tp1["image"], f"CFG-parallel group {c} vs TP 1")
        assert mx <= TP_MAX_PIXEL and mean <= MEAN_PIXEL
        mx, mean = _diff(r["own_only"], tp1["image"], f"broken: group {c} without the exchange vs TP 1")
        assert mean > MEAN_PIXEL and mx > MAX_PIXEL
