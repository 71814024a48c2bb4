"""Issue 10: LoRAs merged at build time, one file per published key format, against diffusers'
load_lora_weights + fuse_lora; merged builds and a second checkpoint compile nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from qic.errors import ConfigError
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
from tests.conftest import BUCKETS, TINY_RES, image_diff, qic
from tests.helpers import rewritten_bundle
from tests.test_nocfg import BOUND_MAX, BOUND_MEAN

RANK, ALPHA, SCALE, STEPS = 4, 6.0, 0.7, 2    # alpha / rank = 1.5 and scale 0.7: neither factor is 1
# Linear layers of the tiny denoiser: top-level, attention (both streams), MLP and modulation.
MODULES = ("img_in", "proj_out", "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0",
           "transformer_blocks.1.attn.add_k_proj", "transformer_blocks.0.img_mlp.net.0.proj",
           "transformer_blocks.1.txt_mod.1")
FORMATS = ("peft", "peft-default", "kohya", "diffusion_model", "diffusers")
PROMPT = "a red bicycle"


def _factors(ckpt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(down [r, in], up [out, r]) per module, large enough to change the image visibly."""
    from qic.checkpoint.reader import Checkpoint
    infos = Checkpoint(ckpt).weights("transformer").tensors
    g = torch.Generator().manual_seed(10)
    out = {}
    for m in MODULES:
        o, i = infos[f"{m}.weight"].shape
        out[m] = (torch.randn(RANK, i, generator=g) / i ** 0.5, torch.randn(o, RANK, generator=g) * 0.5 / RANK ** 0.5)
    return out


def _kohya(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def write_lora(fmt: str, factors: dict, path) -> None:
    sd = {}
    for m, (down, up) in factors.items():
        alpha = torch.tensor(ALPHA)  # one tensor per key: safetensors refuses shared storage
        if fmt == "peft":
            sd |= {f"{m}.lora_A.weight": down, f"{m}.lora_B.weight": up, f"{m}.alpha": alpha}
        elif fmt == "peft-default":
            sd |= {f"{m}.lora_A.default.weight": down, f"{m}.lora_B.default.weight": up, f"{m}.alpha": alpha}
        elif fmt == "kohya":
            k = _kohya(m)
            sd |= {f"{k}.lora_down.weight": down, f"{k}.lora_up.weight": up, f"{k}.alpha": alpha}
        elif fmt == "diffusion_model":
            p = f"diffusion_model.{m}"
            sd |= {f"{p}.lora_A.weight": down, f"{p}.lora_B.weight": up, f"{p}.alpha": alpha}
        elif fmt == "diffusers":  # save_lora_weights: alpha lives in the adapter config in the header
            sd |= {f"{m}.lora_A.weight": down, f"{m}.lora_B.weight": up}
        else:
            raise ValueError(fmt)
    if fmt == "diffusers":
        from diffusers import QwenImagePipeline
        QwenImagePipeline.save_lora_weights(
            path.parent, transformer_lora_layers=sd, weight_name=path.name,
            transformer_lora_adapter_metadata={"r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES)})
        with open(path, "rb") as f:  # the file diffusers wrote: prefixed keys, alpha only in the metadata
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert all(k.startswith("transformer.") for k in header if k != "__metadata__")
        assert "lora_adapter_metadata" in header["__metadata__"]
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))


@pytest.fixture(scope="module")
def loras(tiny_ckpt, workdir):
    d = workdir / "loras"
    d.mkdir(exist_ok=True)
    factors = _factors(tiny_ckpt)
    paths = {}
    for fmt in FORMATS:
        paths[fmt] = d / f"{fmt}.safetensors"
        write_lora(fmt, factors, paths[fmt])
    return paths


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from diffusers import QwenImagePipeline
    p = QwenImagePipeline.from_pretrained(str(tiny_ckpt), torch_dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _diffusers_image(pipe, lora=None):
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name="test")
        pipe.fuse_lora(lora_scale=SCALE)
    try:
        h, w = TINY_RES
        return pipe(PROMPT, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=STEPS, height=h, width=w,
                    generator=torch.Generator("cpu").manual_seed(0)).images[0]
    finally:
        if lora is not None:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()


def _build(ckpt, cache_dir, out, **extra) -> dict:
    """In process (no interpreter start per build), at the session bundle's shapes (one of its buckets), so
    every graph is in the compile cache. Returns the build table: "stage item" -> "cached" | "built"."""
    from qic.builder.pipeline import build
    from qic.spec import load_spec
    report = build(load_spec(None, {"model": str(ckpt), "cache_dir": str(cache_dir), "output": str(out),
                                    "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": BUCKETS[0],
                                    **extra}))
    return {f"{r.stage} {r.item}": "cached" if r.cached else "built" for r in report.rows}


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_merged_image_equals_diffusers_fused(fmt, loras, pipe, bundle, tiny_ckpt, cache_dir, workdir):
    out = workdir / f"bundle-lora-{fmt}"
    rows = _build(tiny_ckpt, cache_dir, out, loras=[f"{loras[fmt]}:{SCALE}"])
    graphs = {k: v for k, v in rows.items() if k.startswith("compile")}
    assert graphs and set(graphs.values()) == {"cached"}, rows        # LoRA weights: no compile
    assert rows["shard denoiser"] == "built" and rows["shard text_encoder"] == "cached"
    m = json.loads((out / "manifest.json").read_text())
    assert m["loras"][0]["scale"] == SCALE and m["loras"][0]["file"] == f"{fmt}.safetensors"
    ours = generate(Bundle(out), Request(PROMPT, steps=STEPS)).image
    ref = _diffusers_image(pipe, loras[fmt])
    mx, mean = image_diff(ours, ref)
    print(f"LoRA {fmt}: qic merged vs diffusers fused: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    if fmt == "peft":  # the bound can fail: without the LoRA, the image is another one
        base = _diffusers_image(pipe)
        assert image_diff(ours, base)[0] > BOUND_MAX


def test_lora_with_an_unknown_key_is_refused_naming_it(loras, tiny_ckpt, tmp_path):
    from safetensors.torch import load_file
    sd = load_file(str(loras["peft"]))
    bad = tmp_path / "bad.safetensors"
    save_file({**sd, "transformer_blocks.0.attn.to_qq.lora_A.weight": torch.zeros(RANK, 128)}, str(bad))
    proc = qic("build", "--model", tiny_ckpt, "--cache-dir", tmp_path / "cache", "--output", tmp_path / "b",
               "--lora", bad, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    first = next(line for line in proc.stderr.splitlines() if line.strip())
    assert first.startswith("error: ") and "'transformer_blocks.0.attn.to_qq.lora_A.weight'" in first, proc.stderr
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("shards/*"))  # nothing written
    # Other faults name their key too: a shape that does not fit, a text-encoder key, an unknown suffix.
    from qic.checkpoint.lora import load_lora
    from qic.checkpoint.reader import Checkpoint
    weights = Checkpoint(tiny_ckpt).weights("transformer").tensors
    for key, value, expect in (("img_in.lora_B.weight", torch.zeros(127, RANK), "'img_in.lora_B.weight'"),
                               ("lora_te_text_model.lora_down.weight", torch.zeros(RANK, 8), "text encoder"),
                               ("img_in.lora_mid.weight", torch.zeros(RANK, RANK), "'img_in.lora_mid.weight'")):
        save_file({**sd, key: value}, str(bad))
        with pytest.raises(ConfigError, match=expect):
            load_lora(bad, 1.0, weights)


def test_second_checkpoint_of_the_same_architecture_compiles_nothing(bundle, tiny_ckpt, cache_dir, workdir,
                                                                     monkeypatch):
    """Another checkpoint of the architecture, saved by another diffusers (as Qwen-Image-2512 is next to
    Qwen-Image): new shards, no graph exported or compiled; and `--weights` runs one bundle's graphs with
    the other's weights."""
    other = _finetune(tiny_ckpt, workdir / "ckpt-tiny-finetune")
    import qic.builder.compile as stage2

    def forbidden(*a, **k):
        raise AssertionError("a build of the same architecture exported a graph")
    monkeypatch.setattr(stage2.torch.export, "export", forbidden)
    out = workdir / "bundle-finetune"
    rows = _build(other, cache_dir, out)
    assert rows["shard denoiser"] == "built"
    assert {v for k, v in rows.items() if k.startswith("compile")} == {"cached"}, rows
    monkeypatch.undo()
    # The session bundle's graphs with the fine-tune's weights give the fine-tune bundle's image, bit for bit.
    req = dict(prompt=PROMPT, steps=2, guidance=1.0)
    swapped = generate(Bundle(bundle, weights_from=out), Request(**req)).image
    own = generate(Bundle(out), Request(**req)).image
    base = generate(Bundle(bundle), Request(**req)).image
    assert image_diff(swapped, own) == (0.0, 0.0) and image_diff(swapped, base)[0] > BOUND_MAX


def _finetune(src, dst):
    from safetensors.torch import load_file
    if not dst.exists():
        shutil.copytree(src, dst)
        for f in (dst / "transformer").glob("*.safetensors"):
            save_file({k: v * 1.05 for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
        for folder in ("transformer", "vae", "text_encoder"):
            cfg = dst / folder / "config.json"
            cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "_diffusers_version": "0.99.0"}))
    return dst


def test_weights_of_another_architecture_are_refused(bundle, tmp_path):
    """A fake 'other architecture' bundle: the session bundle with one denoiser tensor reshaped, its manifest
    re-hashed so that only the signature check can refuse it."""
    from qic.errors import BundleError
    names = []

    def reshape_first(sd):
        names.append(name := sorted(sd)[0])
        return {**sd, name: torch.cat([sd[name], sd[name]])}
    other = rewritten_bundle(bundle, tmp_path / "other", "denoiser", reshape_first)
    [name] = names
    with pytest.raises(BundleError, match=f"graph signatures differ: denoiser tensor {name}"):
        Bundle(bundle, weights_from=other)
    proc = qic("run", bundle, "--prompt", PROMPT, "--weights", other, check=False)
    first = next(line for line in proc.stderr.splitlines() if line.strip())
    assert proc.returncode == 2 and "graph signatures differ" in first, proc.stderr
