"""The embedded tiny checkpoint: determinism, atomic reuse, exact hub layout, and a diffusers pipeline run."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qic.checkpoint import presets
from qic.checkpoint.embedded import MARKER_NAME, VAE_KERNEL_SCALE, is_complete, write_checkpoint
from qic.checkpoint.tensor_names import (
    hub_to_transformers5,
    text_encoder_tensors,
    transformer_tensors,
    vae_tensors,
)
from qic.errors import CheckpointError

PRESETS = ["tiny", "tiny-alt"]


def _tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    out = {}
    for name in PRESETS:
        t = time.perf_counter()
        out[name] = write_checkpoint(root / name, name, seed=0)
        print(f"\nwrite_checkpoint({name!r}): {time.perf_counter() - t:.2f} s")
    return out


# ---------------------------------------------------------------------------------------------- layout


def test_layout(ckpts):
    root = ckpts["tiny"]
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert index["tokenizer"] == ["transformers", "Qwen2Tokenizer"]
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLQwenImage"]
    for rel in ["scheduler/scheduler_config.json", "text_encoder/config.json", "transformer/config.json",
                "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "tokenizer/tokenizer.json",
                "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer_config.json",
                "tokenizer/added_tokens.json", "tokenizer/special_tokens_map.json"]:
        assert (root / rel).is_file(), rel
    for comp, stem in [("text_encoder", "model"), ("transformer", "diffusion_pytorch_model")]:
        idx = json.loads((root / comp / f"{stem}.safetensors.index.json").read_text())
        shards = sorted(set(idx["weight_map"].values()))
        assert len(shards) >= 2 and shards[0] == f"{stem}-00001-of-{len(shards):05d}.safetensors"
        total = 0
        for s in shards:
            sd = load_file(str(root / comp / s))
            assert all(idx["weight_map"][k] == s for k in sd)
            total += sum(t.numel() * t.element_size() for t in sd.values())
        assert idx["metadata"]["total_size"] == total
    cfg = json.loads((root / "transformer" / "config.json").read_text())
    assert cfg == presets.preset("tiny")["transformer"]


def test_enumerated_names_match_reference(ckpts):
    """qic's enumerators == diffusers/transformers state_dict names and shapes (order too), both presets."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    for name in PRESETS:
        p = presets.preset(name)
        with torch.device("meta"):
            refs = {
                "transformer": QwenImageTransformer2DModel.from_config(p["transformer"]),
                "vae": AutoencoderKLQwenImage.from_config(p["vae"]),
                "text_encoder": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_dict(p["text_encoder"])),
            }
        mine = {
            "transformer": transformer_tensors(p["transformer"]),
            "vae": vae_tensors(p["vae"]),
            "text_encoder": [(hub_to_transformers5(n), s) for n, s in text_encoder_tensors(p["text_encoder"])],
        }
        for comp, model in refs.items():
            ref = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
            assert mine[comp] == ref, (name, comp, set(mine[comp]) ^ set(ref))
        # and the files hold exactly the enumerated tensors
        root = ckpts[name]
        for comp, fn in [("transformer", transformer_tensors), ("vae", vae_tensors),
                         ("text_encoder", text_encoder_tensors)]:
            files = {}
            for f in glob.glob(str(root / comp / "*.safetensors")):
                files.update({k: tuple(v.shape) for k, v in load_file(f).items()})
            assert files == dict(fn(p[comp])), (name, comp)


@pytest.mark.parametrize("name", PRESETS)
def test_components_load_without_missing_or_unexpected(ckpts, name):
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    root = ckpts[name]
    for cls, sub in [(QwenImageTransformer2DModel, "transformer"), (AutoencoderKLQwenImage, "vae"),
                     (Qwen2_5_VLForConditionalGeneration, "text_encoder")]:
        model, info = cls.from_pretrained(str(root / sub), output_loading_info=True)
        assert not info["missing_keys"], (sub, info)
        assert not info["unexpected_keys"], (sub, info)
        assert not info.get("mismatched_keys"), (sub, info)
        assert not info.get("error_msgs"), (sub, info)
        # the values landed where the names say (transformers renames the hub's model./visual. prefixes)
        sd = model.state_dict()
        files = {}
        for f in glob.glob(str(root / sub / "*.safetensors")):
            files.update(load_file(f))
        rename = hub_to_transformers5 if sub == "text_encoder" else (lambda n: n)
        assert set(sd) == {rename(k) for k in files}
        for k, v in files.items():
            assert sd[rename(k)].dtype == torch.float32
            assert torch.equal(sd[rename(k)], v), (sub, k)


# ---------------------------------------------------------------------------------- determinism, reuse


def test_generator_uses_no_reference_libraries(tmp_path):
    """The generator is qic's own code: diffusers/transformers are test-only. Also times a cold generation."""
    code = ("import sys, time; t = time.perf_counter(); from qic.checkpoint.embedded import write_checkpoint; "
            f"write_checkpoint({str(tmp_path / 'ck')!r}); dt = time.perf_counter() - t; "
            "print(sorted(m for m in ('transformers', 'diffusers') if m in sys.modules)); print(f'{dt:.2f}')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    print(f"\ncold import + write_checkpoint('tiny') in a fresh process: {out[-1]} s")
    assert out[0] == "[]"
    assert float(out[-1]) < 30


def test_deterministic_and_seeded(ckpts, tmp_path):
    a = _tree_hashes(ckpts["tiny"])
    b = _tree_hashes(write_checkpoint(tmp_path / "again", "tiny", seed=0))
    assert a == b
    c = _tree_hashes(write_checkpoint(tmp_path / "seed1", "tiny", seed=1))
    assert set(c) == set(a)
    differ = {k for k in a if a[k] != c[k]}
    assert {k for k in differ if k.endswith(".safetensors")} == {k for k in a if k.endswith(".safetensors")}
    assert not any(k.startswith("tokenizer/") for k in differ)  # the tokenizer does not depend on the seed
    assert _tree_hashes(ckpts["tiny-alt"]) != a


def test_reuse_regenerate_and_refuse(tmp_path):
    out = write_checkpoint(tmp_path / "ck", "tiny", seed=3)
    assert is_complete(out, "tiny", 3) and not is_complete(out, "tiny", 4)
    assert not [p for p in tmp_path.iterdir() if p.name != "ck"]  # no temp dirs left behind
    weights = out / "vae" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert write_checkpoint(out, "tiny", seed=3) == out
    assert weights.stat().st_mtime_ns == mtime  # reused, not rewritten
    # incomplete -> regenerated
    (out / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    assert not is_complete(out, "tiny", 3)
    before = _tree_hashes(write_checkpoint(tmp_path / "fresh", "tiny", seed=3))
    write_checkpoint(out, "tiny", seed=3)
    assert _tree_hashes(out) == before
    # a different seed replaces an embedded checkpoint in place
    write_checkpoint(out, "tiny", seed=4)
    assert json.loads((out / MARKER_NAME).read_text())["seed"] == 4
    # the vocab/merges-only form
    nt = write_checkpoint(tmp_path / "notj", "tiny", seed=3, tokenizer_json=False)
    assert not (nt / "tokenizer" / "tokenizer.json").exists()
    assert (nt / "tokenizer" / "vocab.json").is_file()
    # a foreign non-empty directory is never overwritten
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not an embedded"):
        write_checkpoint(foreign)
    assert (foreign / "mine.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match="unknown"):
        write_checkpoint(tmp_path / "x", "huge")
    assert os.stat(weights).st_mode & 0o044 == 0o044  # readable by others, like any downloaded checkpoint


def test_vae_output_spread(ckpts):
    """Decoded random latents are neither flat nor saturated (the reason for VAE_KERNEL_SCALE)."""
    from diffusers import AutoencoderKLQwenImage

    for name in PRESETS:
        vae = AutoencoderKLQwenImage.from_pretrained(str(ckpts[name] / "vae"))
        z = vae.config.z_dim
        lat = torch.randn(2, z, 1, 6, 10, generator=torch.Generator().manual_seed(0))
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        with torch.no_grad():
            img = vae.decode(lat * std + mean).sample
        clipped = float((img.abs() >= 0.999).float().mean())
        print(f"\nVAE {name} (kernel scales {VAE_KERNEL_SCALE}): std {img.std():.3f}, clipped {clipped:.1%}")
        assert 0.2 < float(img.std()) < 0.7
        assert clipped < 0.10


# ------------------------------------------------------------------------------------------ the pipeline


@contextlib.contextmanager
def _library_warnings():
    """Collect WARNING+ records of diffusers/transformers (their loggers do not propagate to pytest)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Keep(level=logging.WARNING)
    loggers = [logging.getLogger("diffusers"), logging.getLogger("transformers")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _load_pipeline(path):
    from diffusers import QwenImagePipeline

    with _library_warnings() as records:
        pipe = QwenImagePipeline.from_pretrained(str(path))
    bad = [r.getMessage() for r in records
           if any(w in r.getMessage().lower() for w in ("missing", "unexpected", "initialized", "not used",
                                                          "mismatch", "were not"))]
    assert not bad, bad
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, prompt, cfg=4.0, h=48, w=80):
    out = pipe(prompt=prompt, negative_prompt=" ", true_cfg_scale=cfg, height=h, width=w, num_inference_steps=3,
               generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    return out.images[0].astype(np.float64) * 255.0


def test_pipeline_sensitivity(ckpts, tmp_path):
    """A 3-step diffusers run: unsaturated, and visibly dependent on one prompt word, CFG on/off, CFG scale."""
    t = time.perf_counter()
    pipe = _load_pipeline(ckpts["tiny"])
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    base = _run(pipe, "a red house under a blue sky")
    t_run = time.perf_counter() - t
    word = _run(pipe, "a green house under a blue sky")
    cfg_off = _run(pipe, "a red house under a blue sky", cfg=1.0)
    cfg_3 = _run(pipe, "a red house under a blue sky", cfg=3.0)
    again = _run(pipe, "a red house under a blue sky")

    saturated = float(((base <= 0.5) | (base >= 254.5)).mean())
    d_word = float(np.abs(base - word).mean())
    d_cfg_off = float(np.abs(base - cfg_off).mean())
    d_cfg_3 = float(np.abs(base - cfg_3).mean())
    print(f"\npipeline tiny 48x80, 3 steps: load {t_load:.2f} s, one run {t_run:.2f} s; pixel std {base.std():.1f}, "
          f"saturated {saturated:.1%}; mean |diff| (0..255): one word {d_word:.2f}, CFG 4->1 {d_cfg_off:.2f}, "
          f"CFG 4->3 {d_cfg_3:.2f}")
    assert base.shape == (48, 80, 3)
    assert np.array_equal(base, again)  # deterministic
    assert saturated < 0.15 and base.std() > 20
    assert d_word > 3.0
    assert d_cfg_off > 3.0
    assert d_cfg_3 > 2.5
    # the vocab/merges-only tokenizer form gives the very same image
    pipe2 = _load_pipeline(write_checkpoint(tmp_path / "notj", "tiny", seed=0, tokenizer_json=False))
    assert np.array_equal(_run(pipe2, "a red house under a blue sky"), base)


def test_pipeline_tiny_alt_runs(ckpts):
    """The other preset loads and runs too (other z_dim, VAE scale factor 4, GQA ratio, heads)."""
    pipe = _load_pipeline(ckpts["tiny-alt"])
    h, w = presets.preset("tiny-alt")["default_resolution"]
    assert pipe.vae_scale_factor == 4
    a = _run(pipe, "a red house under a blue sky", h=h, w=w)
    b = _run(pipe, "a green house under a blue sky", h=h, w=w)
    saturated = float(((a <= 0.5) | (a >= 254.5)).mean())
    print(f"\npipeline tiny-alt {h}x{w}: pixel std {a.std():.1f}, saturated {saturated:.1%}, "
          f"one word {np.abs(a - b).mean():.2f}")
    assert a.shape == (h, w, 3) and np.isfinite(a).all()
    assert saturated < 0.25 and a.std() > 10
    assert np.abs(a - b).mean() > 1.0


def test_an_edit_preset_is_written_as_an_edit_plus_checkpoint_with_its_own_areas(tmp_path):
    """An edit preset (`edit`: its pipeline class and condition areas; the trained shapes-edit's) is written in the
    Edit checkpoints' layout: model_index.json names QwenImageEditPlusPipeline and a processor, whose folder holds the
    tokenizer files and Qwen2.5-VL's preprocessor_config.json, and records the areas, which the spec reads back; a
    malformed record is refused in one line naming the key."""
    from qic.checkpoint.embedded import PREPROCESSOR_CONFIG, write_checkpoint_from_configs
    from qic.errors import ConfigError
    from qic.spec import condition_areas, model_class
    configs = presets.shapes_edit_architecture(presets.preset("tiny"))
    root = write_checkpoint_from_configs(tmp_path / "edit", configs, "tiny-edit")
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == model_class(str(root)) == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert json.loads((root / "processor" / "preprocessor_config.json").read_text()) == PREPROCESSOR_CONFIG
    assert (root / "processor" / "tokenizer.json").read_bytes() == (root / "tokenizer" / "tokenizer.json").read_bytes()
    assert condition_areas(str(root)) == (128 * 128, 128 * 128)
    assert condition_areas(str(tmp_path / "nowhere")) is None
    (root / "model_index.json").write_text(json.dumps(index | {"_qic_condition_areas": {"vae": 0}}))
    with pytest.raises(ConfigError, match="_qic_condition_areas must be"):
        condition_areas(str(root))
