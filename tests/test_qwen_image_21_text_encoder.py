"""Qwen-Image-2.1's text encoder (qic.models.qwen_image_21.text_encoder) against transformers 5's
Qwen3VLForConditionalGeneration read the way diffusers' QwenImage21Pipeline reads it: a forward hook makes the
language model's final norm return its input, `hidden_states[-1]` is taken, its valid tokens kept and the
system-prompt tokens dropped. fp32 on CPU, a small random config made with transformers' own config classes
(2 decoder layers, 9 query / 3 key-value heads, head_dim 16 not hidden / heads, vision tower of depth 1 with one
deepstack feature), weights re-drawn with sensitize_ so outputs depend on every weight.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

from qic.errors import ConfigError
from qic.host.image_tokens import expand_image_pads, mrope_positions
from qic.models.common import load_weights
from qic.models.qwen_image_21.host.prompt import prompt_text as prompt_text_of
from qic.models.qwen_image_21.text_encoder import (
    TP_PLAN,
    QwenImage21TextEncoder,
    TextEncoder21Config,
    text_encoder_state_dict,
)
from tests.helpers import fp32_reorder_bound, rel_l2, sensitize_

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "fixtures" / "qwen-image-2.1-configs" / "text_encoder" / "config.json"
VOCAB, IMAGE_ID = 1000, 999
DROP = 5  # a stand-in for the pipeline's _drop_idx (the tokenized system message's length)
HIDDEN, INTER, LAYERS = 96, 160, 2
# fp32 reordering bound (tests/helpers.py): sums at most max(hidden, intermediate) long, about eight in sequence
# per layer (q/k/v, q/k norms, scores, weighting, o, gate/up, down). About 1.2e-5; a wrong input or weight moves
# the result by 1e-2 or more (the broken variants below), a thousand times this.
BOUND = fp32_reorder_bound(max(HIDDEN, INTER), 8 * LAYERS)
BROKEN_MIN = 1e-2


def _hf_config():
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=HIDDEN,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=IMAGE_ID, vision_start_token_id=997, vision_end_token_id=998, video_token_id=996)


def _config_dict() -> dict:
    return json.loads(_hf_config().to_json_string())  # what save_pretrained writes as config.json


@pytest.fixture(scope="module")
def ref():
    model = transformers.Qwen3VLForConditionalGeneration(_hf_config())
    model.set_attn_implementation("sdpa")
    return sensitize_(model.eval())


def _qic(ref, drop: int = DROP, tp_size: int = 1) -> QwenImage21TextEncoder:
    m = QwenImage21TextEncoder(TextEncoder21Config.from_dict(_config_dict()), tp_size=tp_size, drop_tokens=drop)
    load_weights(m, text_encoder_state_dict(ref.state_dict()), "text_encoder")
    return m.eval()


@pytest.fixture(scope="module")
def module(ref):
    return _qic(ref)


def _pipeline_embeds(ref, ids, mask, drop=DROP, **vision):
    """What QwenImage21Pipeline._get_qwen_prompt_embeds computes: one [valid - drop, hidden] tensor per row."""
    handle = ref.model.language_model.norm.register_forward_hook(lambda mod, args, out: args[0])
    try:
        hidden = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, **vision).hidden_states[-1]
    finally:
        handle.remove()
    return [h[m.bool()][drop:] for h, m in zip(hidden, mask)]


def _text_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 990, (n,), generator=g)  # below the special ids


def _padded(rows: list[torch.Tensor], bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), bucket, dtype=torch.long)
    mask = torch.zeros(len(rows), bucket, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        ids[i, len(r):] = 7  # any id: right padding must not matter
        mask[i, : len(r)] = 1
    return ids, mask


def _signal(want: torch.Tensor):
    # The reference must carry signal, or agreement proves nothing.
    assert want.std() > 0.1 and (want[1:] - want[:-1]).abs().mean() > 0.1


# ------------------------------------------------------------------------------------------ text only

@torch.no_grad()
def test_text_matches_the_pipeline_reading(ref, module):
    rows = [_text_ids(19, 0), _text_ids(13, 1)]
    ids, mask = _padded(rows, bucket=24)
    got = module(ids, mask)
    assert got.shape == (2, 24 - DROP, HIDDEN)
    errs, maxabs = [], 0.0
    for i, r in enumerate(rows):
        # the pipeline encodes one prompt at a time, unpadded
        want = _pipeline_embeds(ref, r[None], torch.ones(1, len(r), dtype=torch.long))[0]
        _signal(want)
        n = len(r) - DROP
        errs.append(rel_l2(got[i, :n], want))
        maxabs = max(maxabs, float((got[i, :n] - want).abs().max()))
        assert errs[-1] <= BOUND, f"row {i}: rel-L2 {errs[-1]:.3g} > {BOUND:.3g}"
        assert torch.equal(got[i, n:], torch.zeros_like(got[i, n:]))  # the pipeline's zero padding
    # transformers given the same right-padded batch agrees on the valid tokens too
    for i, want in enumerate(_pipeline_embeds(ref, ids, mask)):
        assert rel_l2(got[i, : len(want)], want) <= BOUND
    # unpadded batch (every token valid)
    full = torch.stack([_text_ids(16, 2), _text_ids(16, 3)])
    ones = torch.ones_like(full)
    got = module(full, ones)
    for i, want in enumerate(_pipeline_embeds(ref, full, ones)):
        errs.append(rel_l2(got[i], want))
        assert errs[-1] <= BOUND
    print(f"\ntext: rel-L2 <= {max(errs):.3g} (bound {BOUND:.3g}), max-abs {maxabs:.3g} "
          f"(reference std {float(want.std()):.3g})")


@torch.no_grad()
def test_text_broken_variants_fail(ref, module):
    r = _text_ids(19, 0)
    one = torch.ones(1, len(r), dtype=torch.long)
    want = _pipeline_embeds(ref, r[None], one)[0]
    assert rel_l2(module(r[None], one)[0], want) <= BOUND
    # the final norm applied (transformers 5's hidden_states[-1] without the pipeline's hook)
    normed = ref(input_ids=r[None], attention_mask=one, output_hidden_states=True).hidden_states[-1][0, DROP:]
    assert rel_l2(normed, want) > BROKEN_MIN
    post = module.model.language_model.norm(module(r[None], one))[0]
    assert rel_l2(post, want) > BROKEN_MIN
    # one system token too few or too many dropped
    for drop in (DROP - 1, DROP + 1):
        got = _qic(ref, drop=drop)(r[None], one)[0]
        n = min(len(got), len(want))
        assert rel_l2(got[:n], want[:n]) > BROKEN_MIN
    # q/k norms left out (Qwen2.5-VL's attention)
    bare = _qic(ref)
    for layer in bare.model.language_model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    assert rel_l2(bare(r[None], one)[0], want) > BROKEN_MIN


@torch.no_grad()
def test_right_padding_leaves_valid_tokens_exact(module):
    r = _text_ids(11, 4)
    short = module(r[None], torch.ones(1, 11, dtype=torch.long))
    ids, mask = _padded([r], bucket=20)
    # same math; only the matmul blocking changes with the length: the reordering bound
    assert rel_l2(module(ids, mask)[0, : 11 - DROP], short[0]) <= BOUND


# ------------------------------------------------------------------------------------------ images

# (t, h, w) in patches: two aspects, 6 and 8 image tokens after the 2x2 merge
GRIDS = [(1, 4, 6), (1, 8, 4)]


def _image_prompt(grids, prompt_len: int, seed: int) -> torch.Tensor:
    """ids laid out as 2.1's ti2i template: system + user header text, then per image a text label,
    <|vision_start|>, its run of <|image_pad|>, <|vision_end|>, then the prompt."""
    parts = [_text_ids(9, seed)]
    for k, (t, h, w) in enumerate(grids):
        parts += [_text_ids(2, seed + 10 + k), torch.tensor([997]), torch.full((t * h * w // 4,), IMAGE_ID),
                  torch.tensor([998])]
    parts.append(_text_ids(prompt_len, seed + 20))
    return torch.cat(parts)


def _pixels(grids, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, 3 * 2 * 4 * 4, generator=g)  # channels * temporal patch * patch * patch


def _vision(ref, grids):
    thw = torch.tensor(grids)
    out = ref.model.get_image_features(_pixels(grids), thw)
    return (torch.cat(out.pooler_output), torch.stack([torch.cat(f) for f in out.deepstack_features]),
            dict(pixel_values=_pixels(grids), image_grid_thw=thw))


@pytest.mark.parametrize("n_images", [1, 2])
@torch.no_grad()
def test_mrope_positions_match_get_rope_index(ref, n_images):
    grids = GRIDS[:n_images]
    r = _image_prompt(grids, 7, seed=n_images)
    want, _ = ref.model.get_rope_index(r[None], mm_token_type_ids=(r[None] == IMAGE_ID).int(),
                                       image_grid_thw=torch.tensor(grids))
    got = mrope_positions(r.tolist(), IMAGE_ID, grids, merge_size=2)
    assert torch.equal(got, want[:, 0])
    assert not torch.equal(got[1], got[2])  # the image rows and columns really differ
    # padded to a bucket: the valid part is unchanged, the tail counts on as text
    bucket = mrope_positions(r.tolist(), IMAGE_ID, grids, merge_size=2, length=len(r) + 4)
    assert torch.equal(bucket[:, : len(r)], got) and torch.equal(bucket[0, len(r):], got[0, -1] + torch.arange(1, 5))
    with pytest.raises(ConfigError, match="grids given"):
        mrope_positions(r.tolist(), IMAGE_ID, grids + [(1, 2, 2)], merge_size=2)
    with pytest.raises(ConfigError, match="not t\\*h\\*w"):
        mrope_positions(r.tolist(), IMAGE_ID, [(1, 4, 4)] * n_images, merge_size=2)


@pytest.mark.parametrize("n_images", [1, 2])
@torch.no_grad()
def test_images_match_the_pipeline_reading(ref, module, n_images):
    grids = GRIDS[:n_images]
    rows = [_image_prompt(grids, 8, seed=3), _image_prompt(grids, 3, seed=4)]
    bucket = max(map(len, rows)) + 3
    ids, mask = _padded(rows, bucket)
    pos = mrope_positions(rows[0].tolist(), IMAGE_ID, grids, merge_size=2, length=bucket)
    # the layout before the prompt is the template's: one position table serves both rows
    assert torch.equal(pos[:, : len(rows[1])], mrope_positions(rows[1].tolist(), IMAGE_ID, grids, 2))
    embeds, deepstack, vision = _vision(ref, grids)
    got = module(ids, mask, pos, embeds, deepstack)
    errs, maxabs, wants = [], 0.0, []
    for i, r in enumerate(rows):
        mm = (r[None] == IMAGE_ID).int()
        want = _pipeline_embeds(ref, r[None], torch.ones_like(r[None]), mm_token_type_ids=mm, **vision)[0]
        _signal(want)
        wants.append(want)
        errs.append(rel_l2(got[i, : len(want)], want))
        maxabs = max(maxabs, float((got[i, : len(want)] - want).abs().max()))
        assert errs[-1] <= BOUND, f"row {i}: rel-L2 {errs[-1]:.3g}"
    print(f"\n{n_images} image(s): rel-L2 <= {max(errs):.3g} (bound {BOUND:.3g}), max-abs {maxabs:.3g}")

    # Broken on purpose, each must leave the bound far behind:
    want = wants[0]
    n = len(want)
    # text positions (1-D) for the image tokens
    assert rel_l2(module(ids, mask, None, embeds, deepstack)[0, :n], want) > BROKEN_MIN
    # height and width axes swapped
    assert rel_l2(module(ids, mask, pos[[0, 2, 1]], embeds, deepstack)[0, :n], want) > BROKEN_MIN
    # no deepstack
    assert rel_l2(module(ids, mask, pos, embeds, None)[0, :n], want) > BROKEN_MIN
    # contiguous (Qwen2.5-VL) instead of interleaved mRoPE sections
    contiguous = _Contiguous(module)
    assert rel_l2(contiguous(ids, mask, pos, embeds, deepstack)[0, :n], want) > BROKEN_MIN


class _Contiguous(QwenImage21TextEncoder):
    """The module with Qwen2.5-VL's mRoPE layout: frequencies [0, s0) temporal, [s0, s0+s1) height, rest width."""

    def __init__(self, base: QwenImage21TextEncoder):
        super().__init__(base.config, drop_tokens=base.drop_tokens)
        self.load_state_dict(base.state_dict())

    def rope(self, position_ids, dtype):
        cfg = self.config
        s0, s1, s2 = cfg.mrope_section
        sel = torch.cat([position_ids[0:1].expand(s0, -1), position_ids[1:2].expand(s1, -1),
                         position_ids[2:3].expand(s2, -1)]).T.float()  # [L, half]
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        angles = sel * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


@torch.no_grad()
def test_images_do_not_depend_on_padding_ids_or_other_rows(ref, module):
    grids = GRIDS
    r = _image_prompt(grids, 5, seed=7)
    embeds, deepstack, _ = _vision(ref, grids)
    pos = mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 6)
    ids, mask = _padded([r], len(r) + 6)
    a = module(ids, mask, pos, embeds, deepstack)
    ids[0, len(r):] = IMAGE_ID  # padding whose id is <|image_pad|> is no slot, and masked out anyway
    b = module(ids, mask, pos, embeds, deepstack)
    assert torch.equal(a, b)


@torch.no_grad()
def test_bf16_is_as_faithful_as_transformers_bf16(ref):
    """In bf16 (the real checkpoint's dtype) qic must be no further from the fp32 result than transformers' own
    bf16 run is: both round at the same places (RMSNorm scales after the cast back, RoPE tables cast last), so
    their distances to fp32 (measured 1.81e-2 and 1.81e-2, bf16's unit roundoff 3.9e-3 amplified over the
    layers) agree within 10%."""
    grids = GRIDS
    r = _image_prompt(grids, 8, seed=3)
    ids, mask = _padded([r], len(r) + 3)
    pos = mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 3)
    mm = (r[None] == IMAGE_ID).int()
    _, _, vision = _vision(ref, grids)
    want = _pipeline_embeds(ref, r[None], torch.ones_like(r[None]), mm_token_type_ids=mm, **vision)[0]
    ref16 = transformers.Qwen3VLForConditionalGeneration(_hf_config()).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16.set_attn_implementation("sdpa")
    ref16 = ref16.to(torch.bfloat16)
    vision16 = dict(vision, pixel_values=vision["pixel_values"].bfloat16())
    theirs = _pipeline_embeds(ref16, r[None], torch.ones_like(r[None]), mm_token_type_ids=mm, **vision16)[0]
    feats = ref16.model.get_image_features(vision16["pixel_values"], vision["image_grid_thw"])
    ours = _qic(ref).to(torch.bfloat16)(ids, mask, pos, torch.cat(feats.pooler_output),
                                        torch.stack([torch.cat(f) for f in feats.deepstack_features]))[0, : len(want)]
    assert ours.dtype == torch.bfloat16
    theirs_err, ours_err = rel_l2(theirs, want), rel_l2(ours, want)
    assert 1e-3 < theirs_err < 0.1  # a bf16-sized difference, not nothing and not broken
    assert ours_err <= 1.1 * theirs_err, f"bf16: qic {ours_err:.3g} vs transformers {theirs_err:.3g} from fp32"


# ------------------------------------------------------------------------------------------ tensor parallel

def _rank_state(full: dict, rank: int, tp: int) -> dict:
    """One rank's tensors by TP_PLAN, as qic.parallel.plans slices them (padded vocabulary rows are zeros)."""
    import re
    out = {}
    for name, t in full.items():
        dim = next((d for pat, d in TP_PLAN.rules if re.fullmatch(pat, name)), None)
        if dim is None:
            out[name] = t
            continue
        rows = -(-t.shape[dim] // tp)
        part = t.narrow(dim, min(rank * rows, t.shape[dim]), max(0, min(rows, t.shape[dim] - rank * rows)))
        if part.shape[dim] < rows:
            assert name in TP_PLAN.padded
            pad = list(part.shape)
            pad[dim] = rows - part.shape[dim]
            part = torch.cat((part, part.new_zeros(pad)), dim=dim)
        out[name] = part
    for name, (of, dim) in TP_PLAN.rank_tensors.items():
        out[name] = torch.tensor([rank * -(-full[of].shape[dim] // tp)])
    return out


class _ThreadAllReduce:
    """A sum over rank threads, in rank order (what an all_reduce computes, without a process group)."""

    def __init__(self, world: int):
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def for_rank(self, rank: int):
        def reduce(t):
            self.slots[rank] = t
            self.barrier.wait()
            total = self.slots[0]
            for s in self.slots[1:]:
                total = total + s
            self.barrier.wait()
            return total
        return reduce


@torch.no_grad()
def test_tp3_matches_tp1(ref, module):
    tp = 3  # 9 query / 3 kv heads, MLP 160 -> not divisible: use a config whose widths divide
    cfg_d = _config_dict()
    cfg_d["text_config"]["intermediate_size"] = 159
    cfg_d["text_config"]["vocab_size"] = VOCAB  # 1000 rows: ceil(1000 / 3) = 334 a rank, the last padded
    big = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**cfg_d))
    sensitize_(big.eval())
    cfg = TextEncoder21Config.from_dict(cfg_d)
    full = text_encoder_state_dict(big.state_dict())
    one = QwenImage21TextEncoder(cfg, drop_tokens=DROP)
    load_weights(one, full, "text_encoder")
    grids = GRIDS
    r = _image_prompt(grids, 6, seed=9)
    ids, mask = _padded([r, r[:-3]], len(r) + 2)
    pos = mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 2)
    emb = big.model.get_image_features(_pixels(grids), torch.tensor(grids))
    embeds = torch.cat(emb.pooler_output)
    deepstack = torch.stack([torch.cat(f) for f in emb.deepstack_features])
    want = one(ids, mask, pos, embeds, deepstack)

    def run(skip_reduce: bool = False):
        ar, outs = _ThreadAllReduce(tp), [None] * tp

        def rank_main(rank):
            m = QwenImage21TextEncoder(cfg, tp_size=tp, drop_tokens=DROP)
            load_weights(m, _rank_state(full, rank, tp), "text_encoder")
            lm = m.model.language_model
            lm.embed_tokens.reduce = ar.for_rank(rank)
            for layer in lm.layers:
                layer.self_attn.o_proj.reduce = ar.for_rank(rank)
                layer.mlp.down_proj.reduce = None if skip_reduce else ar.for_rank(rank)
            with torch.no_grad():
                outs[rank] = m(ids, mask, pos, embeds, deepstack)

        threads = [threading.Thread(target=rank_main, args=(k,)) for k in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return outs

    outs = run()
    valid = mask[:, DROP:].bool()
    for o in outs:
        # the same sums split in three and added in another order: the reordering bound
        assert rel_l2(o[valid], want[valid]) <= BOUND
    assert all(torch.equal(outs[0], o) for o in outs[1:])  # every rank holds the whole result
    broken = run(skip_reduce=True)  # the MLP's partial sums not added up
    assert rel_l2(broken[0][valid], want[valid]) > BROKEN_MIN


def test_tp_shard_shapes_and_refusal():
    cfg = TextEncoder21Config.from_dict(_config_dict())
    sd = QwenImage21TextEncoder(dataclasses.replace(cfg, intermediate_size=159), tp_size=3).state_dict()
    p = "model.language_model.layers.0."
    assert sd[p + "self_attn.q_proj.weight"].shape == (3 * 16, HIDDEN)
    assert sd[p + "self_attn.k_proj.weight"].shape == (16, HIDDEN)
    assert sd[p + "self_attn.o_proj.weight"].shape == (HIDDEN, 3 * 16)
    assert sd[p + "self_attn.q_norm.weight"].shape == (16,)  # per head: replicated
    assert sd[p + "mlp.down_proj.weight"].shape == (HIDDEN, 53)
    assert sd["model.language_model.embed_tokens.weight"].shape == (334, HIDDEN)
    with pytest.raises(ConfigError, match=r"num_attention_heads=9 .*tp_size=2"):
        QwenImage21TextEncoder(cfg, tp_size=2)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=3 .*tp_size=9"):
        QwenImage21TextEncoder(cfg, tp_size=9)  # 9 query heads divide, 3 kv heads do not


# ------------------------------------------------------------------------------------------ weights, config

def test_checkpoint_names_load_strict(ref):
    sd = ref.state_dict()
    assert any(k.startswith("model.visual.") for k in sd) and "lm_head.weight" in sd
    own = text_encoder_state_dict(sd)
    assert set(own) == set(QwenImage21TextEncoder(TextEncoder21Config.from_dict(_config_dict())).state_dict())
    assert all(own[k] is sd[k] for k in own)  # no renaming: the checkpoint's names are the module's


def test_published_config_parses():
    cfg = TextEncoder21Config.from_dict(json.loads(FIXTURE.read_text()))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (36, 4096, 32, 8, 128)
    assert cfg.mrope_section == (24, 20, 20) and cfg.rope_theta == 5e6 and not cfg.attention_bias
    assert (cfg.deepstack_layers, cfg.spatial_merge_size, cfg.image_token_id) == (3, 2, 151655)
    # the transformers 5 spelling of the same test config parses like the one the object holds
    assert TextEncoder21Config.from_dict(_config_dict()).mrope_section == (2, 3, 3)


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d["text_config"]["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved"),
    (lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section"),
    (lambda d: d["text_config"].update(num_key_value_heads=4), "num_key_value_heads"),
    (lambda d: d["text_config"].update(sliding_window=8), "sliding_window"),
    (lambda d: d["vision_config"].update(out_hidden_size=64), "out_hidden_size"),
    (lambda d: d.update(some_new_flag=True), "some_new_flag"),
])
def test_config_refusals_name_the_key(edit, key):
    d = _config_dict()
    edit(d)
    with pytest.raises(ConfigError, match=key):
        TextEncoder21Config.from_dict(d)


# ------------------------------------------------------------------------------------------ export

@torch.no_grad()
def test_export_matches_eager(ref, module):
    grids = GRIDS
    r = _image_prompt(grids, 4, seed=11)
    ids, mask = _padded([r, r[:-2]], len(r) + 3)
    pos = mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 3)
    embeds, deepstack, _ = _vision(ref, grids)
    args = (ids, mask, pos, embeds, deepstack)
    ep = torch.export.export(module, args)
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        assert not (isinstance(val, torch.Tensor) and val.dtype.is_complex), node.name
    # nothing baked but the RoPE theta scalar: every table is computed from the inputs
    assert all(c.numel() == 1 for c in ep.constants.values()), {k: c.shape for k, c in ep.constants.items()}
    assert rel_l2(ep.module()(*args), module(*args)) <= BOUND
    # other ids and features through the same program follow eager: nothing data-dependent was frozen
    ids2 = ids.clone()
    ids2[:, -6:-3] = 5
    args2 = (ids2, mask, pos, embeds.flip(0), deepstack * 0.5)
    assert rel_l2(ep.module()(*args2), module(*args2)) <= BOUND


# ------------------------------------------------------------------------------------------ prompt text

class _Handed(Exception):
    """Raised by the capturing processor with what the pipeline handed it."""


class _CapturingProcessor:
    """Stands in for Qwen3VLProcessor only to read the text QwenImage21Pipeline builds (the real one needs a
    video processor, hence torchvision, which the CPU environment lacks)."""

    tokenizer = type("Tok", (), {"encode": staticmethod(lambda s: [IMAGE_ID])})()

    def apply_chat_template(self, *args, **kwargs):
        return [[0] * DROP]

    def __call__(self, **kwargs):
        raise _Handed(kwargs)


@pytest.mark.parametrize("prompt, n_images", [("a red fox", 0), ("", 0), ("make it blue", 1), ("mix these", 2)])
def test_prompt_text_is_the_pipelines(prompt, n_images):
    diffusers = pytest.importorskip("diffusers")
    from PIL import Image

    pipe = diffusers.QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=None,
                                         processor=_CapturingProcessor(), transformer=None)
    images = [Image.new("RGB", (32, 48 + 16 * k)) for k in range(n_images)] or None
    with pytest.raises(_Handed) as handed:
        pipe._get_qwen_prompt_embeds(prompt, image=images, device="cpu")
    assert handed.value.args[0]["text"] == [prompt_text_of(prompt, n_images)]
    assert handed.value.args[0]["padding_side"] == "left"  # several prompts only; one prompt is unpadded


def test_expand_image_pads():
    from qic.models.qwen_image_21.host.prompt import SYSTEM_MESSAGE
    assert all(prompt_text_of(p, n).startswith(SYSTEM_MESSAGE) for p, n in (("a", 0), ("b", 2)))  # what is dropped
    text = expand_image_pads(prompt_text_of("p", 2), GRIDS, merge_size=2)
    assert text.count("<|image_pad|>") == 6 + 8
    assert "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|> <image2>" in text
    with pytest.raises(ConfigError, match="image grids"):
        expand_image_pads(prompt_text_of("p", 1), GRIDS, merge_size=2)


# ------------------------------------------------------------------------------------------ looped layers

@torch.no_grad()
def test_looped_layers_match_unrolled(ref, module):
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image_21.text_encoder import LAYER_PREFIX, LoopedQwenImage21TextEncoder
    cfg = module.config
    looped = LoopedQwenImage21TextEncoder(cfg, drop_tokens=DROP)
    load_weights(looped, stack_block_weights(module.state_dict(), LAYER_PREFIX, cfg.num_layers), "text_encoder")
    assert any(".stacked." in k for k in looped.state_dict())
    assert not any(k.startswith(LAYER_PREFIX + ".0.") for k in looped.state_dict())
    grids = GRIDS
    r = _image_prompt(grids, 5, seed=12)
    ids, mask = _padded([r, r[:-2]], len(r) + 2)
    pos = mrope_positions(r.tolist(), IMAGE_ID, grids, 2, length=len(r) + 2)
    embeds, deepstack, _ = _vision(ref, grids)
    for args in ((ids, mask), (ids, mask, pos, embeds, deepstack)):
        # the same layer code on slices of the stacks: equal in eager mode, bit for bit
        assert torch.equal(looped(*args), module(*args))
    args = (ids, mask, pos, embeds, deepstack)
    ep = torch.export.export(looped, args)
    assert rel_l2(ep.module()(*args), module(*args)) <= BOUND


# ------------------------------------------------------------------------------------------ the pipeline's own code

class _FixedProcessor(_CapturingProcessor):
    """Hands QwenImage21Pipeline._get_qwen_prompt_embeds fixed model inputs (ids laid out as the processor would
    lay them out, left-padded as it pads a batch), so the pipeline's own reading code runs on the real model."""

    def __init__(self, inputs: dict):
        self.inputs = inputs

    def __call__(self, **kwargs):
        return transformers.BatchFeature(self.inputs)


@pytest.mark.parametrize("n_images", [0, 2])
@torch.no_grad()
def test_the_pipelines_own_encode_matches(ref, module, n_images):
    diffusers = pytest.importorskip("diffusers")
    from PIL import Image
    grids = GRIDS[:n_images]
    rows = [_image_prompt(grids, 9, seed=21), _image_prompt(grids, 4, seed=22)]
    longest = max(map(len, rows))
    left = torch.zeros(2, longest, dtype=torch.long)
    left_mask = torch.zeros_like(left)
    for i, r in enumerate(rows):
        left[i, longest - len(r):] = r
        left_mask[i, longest - len(r):] = 1
    inputs = {"input_ids": left, "attention_mask": left_mask, "mm_token_type_ids": (left == IMAGE_ID).int()}
    if n_images:  # one set of images per prompt, as the pipeline hands them
        inputs.update(pixel_values=torch.cat([_pixels(grids)] * 2), image_grid_thw=torch.tensor(grids * 2))
    pipe = diffusers.QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=ref,
                                         processor=_FixedProcessor(inputs), transformer=None)
    images = [Image.new("RGB", (32, 32))] * n_images or None  # only counted: the stand-in ignores them
    want, want_mask, want_pads = pipe._get_qwen_prompt_embeds(["p", "q"], image=images, device="cpu")

    ids, mask = _padded(rows, longest + 2)
    if n_images:
        embeds, deepstack, _ = _vision(ref, grids)
        pos = mrope_positions(rows[0].tolist(), IMAGE_ID, grids, 2, length=longest + 2)
        got = module(ids, mask, pos, embeds, deepstack)
    else:
        got = module(ids, mask)
    n = want.shape[1]
    assert torch.equal(mask[:, DROP:DROP + n].bool(), want_mask.bool())
    assert torch.equal((ids[:, DROP:DROP + n] == IMAGE_ID) & mask[:, DROP:DROP + n].bool(), want_pads.bool())
    assert want_pads.sum() == 2 * sum(t * h * w // 4 for t, h, w in grids)
    err = rel_l2(got[:, :n], want)
    assert err <= BOUND, f"rel-L2 {err:.3g}"
    assert torch.equal(got[:, n:], torch.zeros_like(got[:, n:]))
    print(f"\npipeline's own encode, {n_images} images, 2 prompts left-padded there, right-padded here: rel-L2 "
          f"{err:.3g}, max-abs {float((got[:, :n] - want).abs().max()):.3g}")
