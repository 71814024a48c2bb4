"""Parity of qic's Qwen-Image-2.1 denoiser (prefill + cached decode) with diffusers' QwenImage21Transformer2DModel.

A random diffusers model made with diffusers' own class (2 blocks, 3 heads x 16: an odd head count; fp32, CPU,
eager), weights re-drawn by sensitize_ so the outputs depend visibly on every weight, loaded into qic's module by
the checkpoint's names with strict=True. The reference is called the way QwenImage21Pipeline calls it:
img_mask over the joint sequence (the target's slots appended), img_shapes [conditions..., target], the
prediction sliced to the target's tokens, kv_cache_mode "extract" on the first step and "cached" after.

qic's side runs on a padded bucket (prefix, text rows and condition rows longer than the request, the padding
filled with large garbage) so a leak of padding into real tokens would show.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from qic import family
from qic.errors import ConfigError
from qic.models.common import load_weights
from qic.models.looped import stack_block_weights
from qic.models.qwen_image_21.denoiser import (
    DenoiserConfig,
    QwenImage21Denoiser,
    denoiser_state_dict,
    prefix_attention_bias,
    target_attention_bias,
)
from qic.models.qwen_image_21.host.sequence import JointSequence, positions, prefix_inputs, rope_tables
from qic.models.qwen_image_21.looped import LoopedQwenImage21Denoiser
from qic.parallel import tp as T
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

CONFIG = dict(num_layers=2, attention_head_dim=16, num_attention_heads=3, in_channels=8, out_channels=8,
              context_in_dim=24, mlp_ratio=3, axes_dims_rope=[4, 6, 6])
B = 2
# Bucket padding on qic's side: prefix positions, text-encoder rows, condition latent rows.
PAD_P, PAD_T, PAD_I = 5, 3, 4
# fp32 reordering bound (tests/helpers.py): per block about eight reductions in sequence (modulation, q/k/v,
# scores, weighting, out, SwiGLU up and down) plus the embeddings and the output, each at most the SwiGLU width
# (3 x 48 = 144) long: 4 * 2^-24 * sqrt(144 * 22) = 1.3e-5. qic and diffusers compute the same sums in another
# order (the prefix and target as separate matmuls, real RoPE instead of complex, one masked SDPA instead of
# one per segment); measured 1e-7 .. 6e-7.
TOL = fp32_reorder_bound(3 * 48, 8 * CONFIG["num_layers"] + 6)
# max-abs: one element's error is at most a few times the RMS error, measured against the output's own scale
# (max |reference|); 10 x TOL leaves room for that on 2 x 24 x 8 outputs.
ABS_TOL = 10 * TOL
# A broken variant (the wrong mask, modulation or prefix) must miss by far more than rounding can explain.
BROKEN_MIN = 100 * TOL
FIGURES: dict = {}


@dataclass(frozen=True)
class Case:
    """A request as the text encoder lays it out: its output rows' image-slot mask (one slot per 2x2 latent
    tokens of a condition), the condition grids in order, and the target grid."""

    slots: tuple[bool, ...]
    conds: tuple[tuple[int, int], ...]
    target: tuple[int, int]

    @property
    def seq(self) -> JointSequence:
        return JointSequence.from_slots(self.slots, self.conds, self.target)


def _slots(*runs) -> tuple[bool, ...]:
    """runs: ints are text rows, (h, w) a condition image's h*w/4 slots."""
    out: list[bool] = []
    for r in runs:
        out += [False] * r if isinstance(r, int) else [True] * (r[0] * r[1] // 4)
    return tuple(out)


CASES = {
    "t2i": Case(_slots(7), (), (4, 6)),
    "one_condition": Case(_slots(5, (2, 4), 4), ((2, 4),), (4, 6)),
    # two conditions of different size and aspect, text between them
    "two_conditions": Case(_slots(3, (2, 2), 2, (4, 2), 6), ((2, 2), (4, 2)), (4, 6)),
}


@pytest.fixture(scope="module", autouse=True)
def figures():
    """The measured figures, printed after the module's tests (pytest -s) for the record."""
    yield FIGURES
    for what, fig in FIGURES.items():
        print(f"{what}: {fig}")


def _diffusers():
    """diffusers' 2.1 transformer module, imported when first needed: the spawned TP ranks import this file and
    need none of it (the import costs each of them about 8 s)."""
    from diffusers.models.transformers import transformer_qwenimage21
    return transformer_qwenimage21


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = sensitize_(_diffusers().QwenImage21Transformer2DModel(**CONFIG), seed=3).eval()
    ours = QwenImage21Denoiser(DenoiserConfig.from_dict(dict(ref.config))).eval()
    load_weights(ours, denoiser_state_dict(ref.state_dict()), "transformer")
    return ref, ours


def _inputs(case: Case, seed: int = 0, masked: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    n_cond = sum(h * w for h, w in case.conds)
    text = torch.randn(B, len(case.slots), CONFIG["context_in_dim"], generator=g)
    mask = None
    if masked:  # row 1 is a shorter prompt: its last 2 text rows are right padding (the prompt's tail is text)
        mask = torch.ones(B, len(case.slots), dtype=torch.bool)
        mask[1, -2:] = False
    cond = torch.randn(B, n_cond, CONFIG["in_channels"], generator=g) if case.conds else None
    target = torch.randn(B, math.prod(case.target), CONFIG["in_channels"], generator=g)
    return dict(text=text, mask=mask, cond=cond, target=target)


def _ref(ref, case: Case, x: dict, target, t, cache=None, mode=None):
    n = math.prod(case.target)
    img_mask = torch.tensor(case.slots + (True,) * (n // 4))[None].expand(B, -1)
    hidden = target if x["cond"] is None else torch.cat([x["cond"], target], 1)
    shapes = [[(1, h, w) for h, w in case.conds] + [(1, *case.target)]] * B
    with torch.no_grad():
        out = ref(hidden_states=hidden, encoder_hidden_states=x["text"], timestep=t, img_shapes=shapes,
                  img_mask=img_mask, encoder_hidden_states_mask=x["mask"], kv_cache=cache, kv_cache_mode=mode,
                  return_dict=False)[0]
    return out[:, -n:]


class Bucket:
    """qic's graph inputs for a case on a padded bucket (P, T, I larger than the request)."""

    def __init__(self, case: Case, x: dict, seed: int = 99):
        g = torch.Generator().manual_seed(seed)
        seq = case.seq
        self.P, T = seq.prefix_len + PAD_P, len(case.slots) + PAD_T
        self.text = torch.cat([x["text"], 30 * torch.randn(B, PAD_T, CONFIG["context_in_dim"], generator=g)], 1)
        self.cond = None
        if x["cond"] is not None:
            self.cond = torch.cat([x["cond"], 30 * torch.randn(B, PAD_I, CONFIG["in_channels"], generator=g)], 1)
        self.index, self.block_ids, self.key_valid = prefix_inputs(seq, self.P, T, x["mask"], batch=B)
        self.cos, self.sin = rope_tables(CONFIG["axes_dims_rope"], seq, self.P)

    def prefill(self, model, target, t):
        with torch.no_grad():
            return model.prefill(self.text, self.cond, target, t, self.index, self.block_ids, self.key_valid,
                                 self.cos, self.sin)

    def decode(self, model, target, t, k, v):
        with torch.no_grad():
            return model.decode(target, t, k, v, self.key_valid, self.cos[self.P:], self.sin[self.P:])


def _close(got, want, what: str) -> None:
    rel = rel_l2(got, want)
    err = float((got - want).abs().max() / want.abs().max())
    FIGURES[what] = (f"{rel:.1e}", f"{err:.1e}")
    assert rel <= TOL and err <= ABS_TOL, (what, rel, err, TOL)


def _timesteps():
    return [torch.tensor([0.9, 0.8]), torch.tensor([0.6, 0.55]), torch.tensor([0.3, 0.25])]


# --------------------------------------------------------------------------------------------- sequence tensors

def test_sequence_segments_from_slots():
    assert CASES["two_conditions"].seq.prefix == (("text", 3), ("image", 2, 2), ("text", 2), ("image", 4, 2),
                                                  ("text", 6))
    # two adjacent images are one run of slots but two blocks, cut by their token counts
    adjacent = JointSequence.from_slots(_slots(2, (2, 2), (2, 4), 1), ((2, 2), (2, 4)), (2, 2))
    assert adjacent.prefix == (("text", 2), ("image", 2, 2), ("image", 2, 4), ("text", 1))
    with pytest.raises(ConfigError):
        JointSequence.from_slots(_slots(2, (2, 2)), ((2, 4),), (2, 2))
    with pytest.raises(ConfigError):
        prefix_inputs(CASES["t2i"].seq, 6, 7)   # a prefix longer than the graph's


@pytest.mark.parametrize("name", CASES)
def test_block_causal_mask_is_diffusers_rule(models, name):
    """The graph's mask (prefix rows from block_ids / key_valid, target rows from key_valid) equals diffusers'
    own mask_mod over the joint sequence, at every real position; every padding key is masked."""
    ref, _ = models
    case = CASES[name]
    x = _inputs(case)
    seq, n = case.seq, math.prod(case.target)
    bucket = Bucket(case, x)
    P, S = seq.prefix_len, seq.prefix_len + n
    # diffusers: image ids and the joint key mask as its forward builds them
    slots = torch.tensor(case.slots + (True,) * (n // 4))
    pad_mask = torch.repeat_interleave(slots, torch.where(slots, 4, 1))
    image_ids, _ = ref.build_token_metadata(pad_mask, [(1, h, w) for h, w in case.conds] + [(1, *case.target)])
    key_valid = torch.ones(B, S, dtype=torch.bool)
    key_valid[:, ~pad_mask] = x["mask"][:, ~slots[:len(case.slots)]]
    bm = _diffusers().build_qwenimage21_block_causal_mask(image_ids, key_valid, B, torch.device("cpu"))
    q, kv = torch.arange(S)[:, None], torch.arange(S)[None, :]
    want = torch.stack([bm.mask_mod(torch.tensor(b), torch.tensor(0), q, kv) for b in range(B)])

    prefix = prefix_attention_bias(bucket.block_ids, bucket.key_valid)[:, 0] == 0          # [B, Pb, Pb]
    target = target_attention_bias(bucket.key_valid, n)[:, 0, 0] == 0                      # [B, Pb + N]
    got = torch.zeros(B, S, S, dtype=torch.bool)
    got[:, :P, :P] = prefix[:, :P, :P]                    # prefix rows never see the target: left False
    got[:, P:, :P] = target[:, None, :P]
    got[:, P:, P:] = target[:, None, bucket.P:]
    assert torch.equal(got, want)
    assert not prefix[:, :, P:].any() and not target[:, P:bucket.P].any()   # the bucket's padding keys
    # the check can fail: full attention over the prefix is another mask whenever there is more than one token
    assert not torch.equal(torch.ones_like(prefix[:, :P, :P]) & bucket.key_valid[:, None, :P], want[:, :P, :P])


@pytest.mark.parametrize("name", CASES)
def test_rope_tables_match_diffusers(models, name):
    ref, _ = models
    case = CASES[name]
    seq, n = case.seq, math.prod(case.target)
    slots = torch.tensor(case.slots + (True,) * (n // 4))
    pad_mask = torch.repeat_interleave(slots, torch.where(slots, 4, 1))
    want = ref.pos_embed([(1, h, w) for h, w in case.conds] + [(1, *case.target)], pad_mask, torch.device("cpu"))
    cos, sin = rope_tables(CONFIG["axes_dims_rope"], seq, seq.prefix_len + PAD_P)
    keep = torch.cat([torch.arange(seq.prefix_len), seq.prefix_len + PAD_P + torch.arange(n)])
    # The same fp32 angles; torch.polar and cos/sin differ by a few ulp in [-1, 1].
    torch.testing.assert_close(cos[keep], want.real, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[keep], want.imag, rtol=0, atol=1e-6)
    assert positions(seq, seq.prefix_len + PAD_P)[seq.prefix_len:seq.prefix_len + PAD_P].eq(0).all()


# --------------------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded_text"])
@pytest.mark.parametrize("name", CASES)
def test_prefill_matches_diffusers_without_cache(models, name, masked):
    """(a, c) One full forward: qic's prefill prediction equals diffusers' use_kv_cache=False forward."""
    ref, ours = models
    case = CASES[name]
    x = _inputs(case, masked=masked)
    t = torch.tensor([0.7, 0.4])
    pred, k, v = Bucket(case, x).prefill(ours, x["target"], t)
    want = _ref(ref, case, x, x["target"], t)
    assert pred.shape == want.shape == (B, math.prod(case.target), CONFIG["out_channels"])
    heads, hd, P = CONFIG["num_attention_heads"], CONFIG["attention_head_dim"], case.seq.prefix_len + PAD_P
    assert k.shape == v.shape == (CONFIG["num_layers"], B, heads, P, hd)
    _close(pred, want, f"prefill {name} {'padded' if masked else 'unpadded'}")


def _euler(x, pred, t, t_next):
    return x + (t_next - t)[:, None, None] * pred


@pytest.mark.parametrize("name", CASES)
def test_prefill_then_decode_matches_diffusers_cache(models, name):
    """(b, c) Three sampler steps: qic's prefill then two decodes against the prefix K/V equal diffusers'
    extract-then-cached steps and its no-cache steps, each side on its own Euler trajectory; the cached prefix
    K/V equals diffusers' cache at every real position."""
    ref, ours = models
    case = CASES[name]
    x = _inputs(case)
    bucket = Bucket(case, x)
    ts = _timesteps() + [torch.zeros(2)]
    cache = _diffusers().QwenImage21KVCache(CONFIG["num_layers"])
    lat_ref = lat_nocache = lat_ours = x["target"]
    for i in range(3):
        want = _ref(ref, case, x, lat_ref, ts[i], cache, "extract" if i == 0 else "cached")
        nocache = _ref(ref, case, x, lat_nocache, ts[i])
        if i == 0:
            got, k, v = bucket.prefill(ours, lat_ours, ts[i])
            P = case.seq.prefix_len
            for layer in range(CONFIG["num_layers"]):
                ck, cv = cache.get_layer(layer).get()   # [B, P, H, D]
                _close(k[layer][:, :, :P].transpose(1, 2), ck, f"cached K {name} layer {layer}")
                _close(v[layer][:, :, :P].transpose(1, 2), cv, f"cached V {name} layer {layer}")
        else:
            got = bucket.decode(ours, lat_ours, ts[i], k, v)
        _close(got, want, f"step {i} {name} vs diffusers cached")
        _close(got, nocache, f"step {i} {name} vs diffusers no-cache")
        lat_ref, lat_nocache, lat_ours = (_euler(lat, p, ts[i], ts[i + 1])
                                          for lat, p in ((lat_ref, want), (lat_nocache, nocache), (lat_ours, got)))
    _close(lat_ours, lat_ref, f"latents after 3 steps {name}")


# --------------------------------------------------------------------------------------------- broken on purpose

class FullAttention(QwenImage21Denoiser):
    """Broken: the prefix attends to every real prefix key, not block-causally."""

    @staticmethod
    def prefix_attention_bias(block_ids, key_valid, dtype=torch.float32):
        return target_attention_bias(key_valid, 0, dtype)


class ConditionsAtT(QwenImage21Denoiser):
    """Broken: text and condition tokens modulated at the step's t instead of 0."""

    @staticmethod
    def prefix_timestep(timestep):
        return timestep


def _broken(cls, ours):
    m = cls(ours.config).eval()
    m.load_state_dict(ours.state_dict())
    return m


@pytest.mark.parametrize("name", ["one_condition", "two_conditions"])
def test_broken_variants_fail_the_bound(models, name):
    """(d) Full attention in place of the block-causal mask, condition tokens modulated at t, a stale prefix (the
    K/V of another prompt), and the padding's keys left unmasked each miss diffusers by far more than the bound
    the real model meets."""
    ref, ours = models
    case = CASES[name]
    x = _inputs(case)
    bucket = Bucket(case, x)
    t0, t1 = _timesteps()[:2]
    cache = _diffusers().QwenImage21KVCache(CONFIG["num_layers"])
    want0 = _ref(ref, case, x, x["target"], t0, cache, "extract")
    want1 = _ref(ref, case, x, x["target"], t1, cache, "cached")
    _, k, v = bucket.prefill(ours, x["target"], t0)
    assert rel_l2(bucket.decode(ours, x["target"], t1, k, v), want1) <= TOL   # the unbroken model meets it

    misses = {}
    misses["full attention"] = rel_l2(bucket.prefill(_broken(FullAttention, ours), x["target"], t0)[0], want0)
    misses["conditions at t"] = rel_l2(bucket.prefill(_broken(ConditionsAtT, ours), x["target"], t0)[0], want0)
    other = Bucket(case, {**x, "text": x["text"] + 0.5 * torch.randn_like(x["text"])})   # another prompt
    _, k_other, v_other = other.prefill(ours, x["target"], t0)
    misses["stale prefix"] = rel_l2(bucket.decode(ours, x["target"], t1, k_other, v_other), want1)
    leaky = Bucket(case, x)   # the bucket's padding (and row 1's padded text) left unmasked: its garbage is read
    leaky.key_valid = torch.ones_like(leaky.key_valid)
    misses["padding attended"] = rel_l2(leaky.prefill(ours, x["target"], t0)[0], want0)
    FIGURES[f"broken {name}"] = {w: f"{r:.2e}" for w, r in misses.items()}
    for what, rel in misses.items():
        assert rel > BROKEN_MIN, (what, rel, BROKEN_MIN)


def test_config_refuses_what_it_does_not_implement():
    with pytest.raises(ConfigError, match="causal_condition"):
        DenoiserConfig.from_dict({**CONFIG, "causal_condition": False})
    with pytest.raises(ConfigError, match="zero_cond_t"):
        DenoiserConfig.from_dict({**CONFIG, "zero_cond_t": True})


# --------------------------------------------------------------------------------------------- looped, export

def _looped(ours) -> LoopedQwenImage21Denoiser:
    m = LoopedQwenImage21Denoiser(ours.config).eval()
    load_weights(m, stack_block_weights(ours.state_dict(), "transformer_blocks", ours.config.num_layers),
                 "transformer")
    return m


@pytest.mark.parametrize("name", ["t2i", "two_conditions"])
def test_looped_equals_unrolled(models, name):
    """The scan over stacked block weights runs the unrolled model's layer code on the same tensors: prefill
    (prediction and stacked K/V) and decode equal bit for bit in eager mode."""
    _, ours = models
    looped = _looped(ours)
    case = CASES[name]
    x = _inputs(case)
    bucket = Bucket(case, x)
    t0, t1 = _timesteps()[:2]
    want = bucket.prefill(ours, x["target"], t0)
    got = bucket.prefill(looped, x["target"], t0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    k, v = want[1:]
    assert torch.equal(bucket.decode(looped, x["target"], t1, k, v), bucket.decode(ours, x["target"], t1, k, v))


class _Entry(torch.nn.Module):
    """A graph's module: one entry point of the denoiser as forward (what a graph maker will export)."""

    def __init__(self, model, entry: str):
        super().__init__()
        self.model, self.entry = model, entry

    def forward(self, *args):
        return getattr(self.model, self.entry)(*args)


def _graph_nodes(ep) -> int:
    return sum(len(gm.graph.nodes) for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule))


def test_looped_prefill_and_decode_export_whole(models):
    """torch.export (non-strict, the build's tracer) takes both entry points of the looped form whole: no host
    sync, no data-dependent shape, the block-causal mask built in the graph from the sequence tensors. The
    exported programs equal eager exactly, and the decode graph's size does not grow with depth."""
    _, ours = models
    looped = _looped(ours)
    case = CASES["two_conditions"]
    x = _inputs(case)
    b = Bucket(case, x)
    t0, t1 = _timesteps()[:2]
    pre = (b.text, b.cond, x["target"], t0, b.index, b.block_ids, b.key_valid, b.cos, b.sin)
    with torch.no_grad():
        want = looped.prefill(*pre)
        dec = (x["target"], t1, want[1], want[2], b.key_valid, b.cos[b.P:], b.sin[b.P:])
        ep_pre = torch.export.export(_Entry(looped, "prefill"), pre, strict=False)
        ep_dec = torch.export.export(_Entry(looped, "decode"), dec, strict=False)
        assert all(torch.equal(a, w) for a, w in zip(ep_pre.module()(*pre), want))
        assert torch.equal(ep_dec.module()(*dec), looped.decode(*dec))
        deeper = LoopedQwenImage21Denoiser(dataclasses.replace(looped.config, num_layers=5)).eval()
        k5, v5 = (t[:1].expand(5, *t.shape[1:]).contiguous() for t in want[1:])
        ep_deep = torch.export.export(_Entry(deeper, "decode"), (*dec[:2], k5, v5, *dec[4:]), strict=False)
    assert _graph_nodes(ep_deep) == _graph_nodes(ep_dec)


# --------------------------------------------------------------------------------------------- TP

CONFIG_TP = {**CONFIG, "num_attention_heads": 4}   # 4 heads, 192 SwiGLU columns: both divide by 2


def _rank_tp(rank: int, tp: int, path: str) -> dict:
    """One rank: its TP_PLAN shard, all-reduces on the world group; prefill, a decode, and a broken run with
    the attention output's reduction skipped."""
    blob = torch.load(path)
    m = QwenImage21Denoiser(DenoiserConfig.from_dict(CONFIG_TP), tp).eval()
    family.use("qwen-image-2.1")   # stage 1's slicing by the component's TPPlan (qic.parallel.plans)
    m.load_state_dict(T.shard_state_dict("denoiser", blob["weights"], rank, tp), strict=True)
    assert T.apply_tp(m) == 2 * CONFIG_TP["num_layers"]
    looped = LoopedQwenImage21Denoiser(m.config, tp).eval()
    looped.load_state_dict(stack_block_weights(m.state_dict(), "transformer_blocks", m.config.num_layers))
    assert T.apply_tp(looped) == 2   # the template's RowLinears: the reductions run inside the scan body
    pre, dec = blob["prefill"], blob["decode"]
    with torch.no_grad():
        pred0, k, v = m.prefill(*pre)
        pred1 = m.decode(dec[0], dec[1], k, v, *dec[2:])
        looped0, looped_k, _ = looped.prefill(*pre)
        looped1 = looped.decode(dec[0], dec[1], k, v, *dec[2:])
        for block in m.transformer_blocks:
            block.attn.to_out[0].reduce = None
        broken = m.prefill(*pre)[0]
    return {"pred0": pred0, "k": k, "v": v, "pred1": pred1, "broken": broken,
            "looped_equal": torch.equal(looped0, pred0) and torch.equal(looped_k, k) and torch.equal(looped1, pred1)}


@pytest.mark.slow
def test_tp2_matches_tp1(tmp_path):
    """(e) TP 2 on a gloo world of 2 processes equals TP 1: predictions of a prefill and a decode, and the
    prefix K/V (each rank holds its heads' half). A skipped reduction fails the same bound."""
    cfg = DenoiserConfig.from_dict(CONFIG_TP)
    full = sensitize_(QwenImage21Denoiser(cfg), seed=11).eval()
    case = CASES["two_conditions"]
    x = _inputs(case)
    bucket = Bucket(case, x)
    t0, t1 = _timesteps()[:2]
    pre = (bucket.text, bucket.cond, x["target"], t0, bucket.index, bucket.block_ids, bucket.key_valid,
           bucket.cos, bucket.sin)
    dec = (x["target"] + 0.1, t1, bucket.key_valid, bucket.cos[bucket.P:], bucket.sin[bucket.P:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # like each rank
    try:
        pred0, k, v = bucket.prefill(full, x["target"], t0)
        pred1 = bucket.decode(full, dec[0], t1, k, v)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path / "tp.pt"
    torch.save({"weights": full.state_dict(), "prefill": pre, "decode": dec}, path)
    ranks = T.spawn(_rank_tp, 2, str(path), timeout=300)
    # TP splits each row-parallel matmul into two partial sums plus an all-reduce: the same sums reordered.
    for r in ranks:
        assert r["looped_equal"]   # the looped form on the same rank: bit for bit
        _close(r["pred0"], pred0, "TP2 prefill")
        _close(r["pred1"], pred1, "TP2 decode")
        FIGURES["TP2 attention reduction skipped (broken)"] = f"{rel_l2(r['broken'], pred0):.2e}"
        assert rel_l2(r["broken"], pred0) > BROKEN_MIN
    _close(torch.cat([r["k"] for r in ranks], 2), k, "TP2 prefix K")
    _close(torch.cat([r["v"] for r in ranks], 2), v, "TP2 prefix V")
