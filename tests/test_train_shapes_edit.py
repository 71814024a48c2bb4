"""training/shapes_edit.py (the edit grammar, its held-out pairs, the meaning check) and training/train_shapes_edit.py
(the embedded shapes-edit model's trainer): its smoke mode runs every stage and writes what the package data is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from training import shapes, shapes_edit


def test_each_instruction_changes_what_it_names_and_keeps_the_rest():
    t = ("red", "circle", "blue")
    assert shapes_edit.apply("make the shape green", t) == ("green", "circle", "blue")
    assert shapes_edit.apply("make the background white", t) == ("red", "circle", "white")
    assert shapes_edit.apply("turn the circle into a triangle", t) == ("red", "triangle", "blue")
    # 6 free colours for the shape, 6 for the background, 2 other shapes
    assert len(shapes_edit.instructions(t)) == 14
    for bad in ("make the shape red", "make the shape blue", "make the background red", "turn the square into a "
                "circle", "turn the circle into a circle", "make it pink"):
        with pytest.raises(ValueError, match="not an instruction"):
            shapes_edit.apply(bad, t)


def test_held_out_pairs_are_new_pairings_of_known_words_and_pictures():
    train, held = set(shapes_edit.TRAIN), set(shapes_edit.HELD_OUT)
    assert not train & held and len(train) + len(held) == len(shapes_edit.PAIRS) == 168 * 14
    assert 0.09 <= len(held) / len(shapes_edit.PAIRS) <= 0.11
    assert {i for i, _ in held} <= {i for i, _ in train}          # every held-out instruction is trained with others
    assert {t for _, t in held} <= {t for _, t in train}          # and every held-out picture
    assert {shapes_edit.form(i) for i, _ in shapes_edit.check_pairs(24)} == {"colour", "background", "shape"}


def test_the_meaning_check_reads_the_named_change_and_the_kept_attributes():
    """On rendered pictures: the edit's target passes; the unedited input, an edit of another attribute and an edit
    to another value fail."""
    t, h, w = ("yellow", "square", "purple"), 128, 128
    ins = "make the background green"
    assert shapes_edit.edited_as_told(shapes.render("yellow", "square", "green", h, w, 0.5), ins, t)
    for wrong in (t, ("green", "square", "purple"), ("yellow", "square", "black"), ("yellow", "circle", "green")):
        assert not shapes_edit.edited_as_told(shapes.render(*wrong, h, w, 0.5), ins, t), wrong


def test_the_packaged_record_names_its_base_and_what_it_was_trained_and_measured_with():
    meta = json.loads((ROOT / "qic" / "checkpoint" / "data" / "shapes-edit" / "trained.json").read_text())
    base = json.loads((ROOT / "qic" / "checkpoint" / "data" / "shapes" / "trained.json").read_text())
    assert meta["base"] == {"model": "shapes", "files": {f: base["files"][f] for f in
                                                         ("text_encoder.safetensors", "vae.safetensors")}}
    assert set(meta["files"]) == {"transformer.safetensors"}
    assert meta["configs"]["edit"]["pipeline"] == "QwenImageEditPlusPipeline"
    # the script's own eval (diffusers' pipeline, shapes of one size) is recorded; the bar is checked through the
    # compiled bundles in tests/test_shapes_edit_model.py
    assert set(meta["training"]["final_eval_20_steps_cfg4"]) == {"held_out", "train"}


@pytest.mark.slow
def test_training_smoke_mode_writes_loadable_weights(tmp_path):
    """`python -m training.train_shapes_edit --smoke`: every stage for a few iterations (its batched prompt
    encoding checked against the pipeline's encode_prompt on the way); what it writes is what the package data is:
    the denoiser (shapes' tensors, its sha256 in trained.json), the configs, and shapes' text encoder and VAE named by
    their digests."""
    import hashlib

    from safetensors.torch import load_file

    from qic.checkpoint import trained
    from qic.checkpoint.presets import shapes_edit_architecture
    out = tmp_path / "shapes-edit"
    proc = subprocess.run([sys.executable, "-m", "training.train_shapes_edit", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batched prompt encoding = the pipeline's" in proc.stdout
    meta = json.loads((out / "trained.json").read_text())
    shapes_data = ROOT / "qic" / "checkpoint" / "data" / "shapes"
    for name, digest in meta["files"].items():   # the denoiser: shapes' tensors, trained on
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
        got, start = load_file(str(out / name)), load_file(str(shapes_data / name))
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in start.items()}
    assert meta["configs"] == shapes_edit_architecture(trained.configs("shapes"))
    assert meta["base"] == {"model": "shapes", "files": {f: trained.record("shapes")["files"][f]
                                                         for f in ("text_encoder.safetensors", "vae.safetensors")}}
    assert meta["training"]["command"].endswith("--smoke")
    # the smoke settings' two cycles (a copy head made before each), their steps numbered on
    assert meta["training"]["settings"]["copy_head"] == "1:2" and len(meta["training"]["settings"]["then"]) == 1
    losses = json.loads((out / "losses.json").read_text())["denoiser"]
    assert [i for i, _ in losses] == list(range(3 + 2))
    # another cycle from that export (--resume): its record names the one it started from
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "training.train_shapes_edit", "--smoke", "--resume", str(out),
                           "--steps", "2", "--out", str(again)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta2 = json.loads((again / "trained.json").read_text())
    assert meta2["training"]["previous"] == {"files": meta["files"], "training": meta["training"]}
    assert meta2["training"]["settings"]["steps"] == 2 and "--resume" in meta2["training"]["command"]
    # one cycle of the settings given, and no second copy head over the trained one
    assert meta2["training"]["settings"]["then"] == [] and meta2["training"]["settings"]["copy_head"] is None


def test_the_trainer_samples_training_pairs_only(monkeypatch):
    """Every (instruction, picture) the denoiser is trained on is a training pair: the trainer's sampling draws from
    shapes_edit.TRAIN (its pairs list), never a held-out one."""
    from training import train_shapes_edit
    seen = []
    real = shapes_edit.apply
    monkeypatch.setattr(shapes_edit, "apply", lambda ins, t: seen.append((ins, t)) or real(ins, t))

    class Stop(Exception):
        pass

    def encode_batch(pipe, prompts, pictures):
        raise Stop
    monkeypatch.setattr(train_shapes_edit, "encode_batch", encode_batch)
    monkeypatch.setattr(train_shapes_edit, "vision_picture", lambda pipe, img, areas: None)
    import torch
    data = {r: {(t, 0): torch.zeros(16, r[0] // 8, r[1] // 8) for t in shapes.TRIPLES}
            for r in train_shapes_edit.RESOLUTIONS}
    cfg = dict(train_shapes_edit.FULL, sizes=1, batch=2000)
    tr = torch.nn.Linear(1, 1)
    with pytest.raises(Stop):
        train_shapes_edit.train_denoiser(None, tr, tr, data, {"edit": {"areas": {"vision": 1}}, "scheduler": {}},
                                         cfg, 0, [], [])
    drawn = seen[len(shapes_edit.TRAIN):]   # after the pairs list's own check of each training pair
    assert len(drawn) == 2000 and set(drawn) <= set(shapes_edit.TRAIN)
    assert not set(drawn) & set(shapes_edit.HELD_OUT)


@pytest.mark.parametrize("grid", [(8, 8), (6, 10)])
def test_a_sharpened_copy_head_attends_to_the_condition_token_under_each_noise_token(monkeypatch, grid):
    """train_shapes_edit.sharpen_copy_head on a denoiser of the shapes model's sizes (random weights): the head puts
    >= 90% of each noise token's attention on the condition token at its place (before: a few %), at a square and a
    wide token grid."""
    import diffusers.models.transformers.transformer_qwenimage as qwen
    import torch
    from diffusers import QwenImageTransformer2DModel

    from qic.checkpoint import trained
    from training.train_shapes_edit import sharpen_copy_head
    probs = []
    real = qwen.dispatch_attention_fn

    def spy(q, k, v, attn_mask=None, **kw):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        probs.append(s.masked_fill(~attn_mask, float("-inf")).softmax(-1))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(qwen, "dispatch_attention_fn", spy)
    torch.manual_seed(0)
    tr = QwenImageTransformer2DModel.from_config(trained.configs("shapes")["transformer"]).eval()
    h, w = grid
    n, txt = h * w, 12
    x = torch.randn(2, 2 * n, tr.config.in_channels)

    def under(block, head):
        probs.clear()
        with torch.no_grad():
            tr(hidden_states=x, encoder_hidden_states=torch.randn(2, txt, tr.config.joint_attention_dim),
               encoder_hidden_states_mask=torch.ones(2, txt, dtype=torch.bool), timestep=torch.full((2,), 0.6),
               img_shapes=[[(1, h, w)] * 2] * 2, return_dict=False)
        to_condition = probs[block][:, head, txt:txt + n, txt + n:]   # noise queries -> condition keys
        return float(torch.diagonal(to_condition, dim1=-2, dim2=-1).mean())

    before = under(1, 2)
    sharpen_copy_head(tr, 1, 2)
    after = under(1, 2)
    assert before < 0.1 and after >= 0.9, (before, after)
