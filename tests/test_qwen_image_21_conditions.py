"""Issue 44: Qwen-Image-2.1's condition (reference) images at build time: `qic build --condition-size HxW
[--condition-images N]` adds the vision-tower and VAE-encoder graphs per condition size, and each graph, run by the
runtime from the bundle, reads a condition image as QwenImage21Pipeline does: transformers' Qwen3-VL vision model on
the image processor's pixel values, diffusers' VAE encode at the mode, normalised and packed.

The session's tiny 2.1 checkpoint (tests/qwen_image_21_checkpoint.py): patch 16, merge 2, a 4x4 position table
resampled to the grid, deepstack at block 0; its processor's pixel bounds (65536..16777216, Qwen3-VL's) keep
condition sizes from 256x256 up. The images run at the session's 64x64 output size (--height/--width, as the pipeline
takes them), so the text-to-image graphs are q21_bundle's and only the condition forms compile.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from qic.host.vl_processor import vision_pixels
from qic.models.qwen_image_21.host.sampling import condition_pixels, vision_image
from qic.models.qwen_image_21.vision import VisionConfig
from tests.conftest import Q21_BUCKET, Q21_SIZE, _build, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL, MEMO, fp32_reorder_bound, memoised, picture_key, rel_l2

CLIP_MEAN, CLIP_STD = (0.481, 0.458, 0.408), (0.269, 0.261, 0.276)   # the processor class's default normalisation
# At output_resolution 320 (the pipeline's default is 1024; the tiny checkpoint runs small) a square picture resizes
# to 320x320 and one of aspect 5:4 to 288x352: not square, so rows and columns of the grid can be told apart. Both
# keep the processor's pixel bounds (65536..16777216, Qwen3-VL's).
OUTPUT_RESOLUTION = 320
SIZES = ((320, 320), (288, 352))
PICTURES = ((400, 400), (400, 500))   # (height, width) of the pictures given: SIZES at OUTPUT_RESOLUTION
STEPS, SEED, PROMPT, NEGATIVE, GUIDANCE = 3, 7, "a red circle on a blue background", "a green square", 4.0


def _build_q21(shared_dir, cache_dir, ckpt, name, *args):
    return _build(shared_dir, name, "--model", ckpt, "--cache-dir", cache_dir, "--resolution",
                  "{}x{}".format(*Q21_SIZE), "--text-buckets", Q21_BUCKET, *args)


@pytest.fixture(scope="module")
def cond_export(shared_dir, cache_dir, q21_ckpt):
    """Two condition sizes, two images a request, the export back end (the graphs' contract, nothing compiled)."""
    sizes = [a for s in SIZES for a in ("--condition-size", "{}x{}".format(*s))]
    return _build_q21(shared_dir, cache_dir, q21_ckpt, "bundle-q21-cond-export", "--backend", "export", *sizes,
                      "--condition-images", 2)


@pytest.fixture(scope="module")
def cond_inductor(shared_dir, cache_dir, q21_ckpt):
    """One condition size compiled: its two graphs are new; the text-to-image ones are q21_bundle's (the same keys)."""
    return _build_q21(shared_dir, cache_dir, q21_ckpt, "bundle-q21-cond", "--condition-size", "{}x{}".format(*SIZES[0]))


def _picture(h: int, w: int, seed: int) -> Image.Image:
    """An RGBA picture of another size than the condition's (the resize is part of the path), alpha varying:
    smooth colour fields plus noise, so both the tower's and the encoder's inputs carry every frequency."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    rgb = np.stack([np.sin(7 * x + seed), np.cos(5 * y - seed), np.sin(3 * (x + y))], -1) * 90 + 128
    rgba = np.concatenate([rgb + rng.normal(0, 25, (h, w, 3)), 255 * (0.3 + 0.7 * x[..., None])], -1)
    return Image.fromarray(np.clip(rgba, 0, 255).astype(np.uint8), "RGBA")


@pytest.fixture(scope="module")
def references(q21_ckpt):
    """transformers' Qwen3-VL (its vision model) and diffusers' VAE from the checkpoint's files, with the image
    processor the checkpoint's processor folder describes (the PIL one: no torchvision here)."""
    import transformers
    from diffusers import AutoencoderKLQwenImage21
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    settings = json.loads((q21_ckpt / "processor" / "preprocessor_config.json").read_text())
    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in settings.items() if k != "image_processor_type"})
    te = transformers.Qwen3VLForConditionalGeneration.from_pretrained(q21_ckpt / "text_encoder",
                                                                      torch_dtype=torch.float32).eval()
    te.set_attn_implementation("sdpa")
    vae = AutoencoderKLQwenImage21.from_pretrained(q21_ckpt / "vae", torch_dtype=torch.float32).eval()
    return proc, te, vae


# fp32 reordering bounds (tests/helpers.py), as the eager modules' tests derive them: the tower's sums are at most
# the merger's width (4 x 32) long, about eight in sequence per block plus the patch embedding and the merger; the
# encoder's one per conv plus the attention's two, each at most the largest conv's fan-in long. A compiled graph
# reorders as eager does, so graph vs reference is within twice the bound. A wrong normalisation, a dropped alpha or
# a transposed grid moves the outputs by 1e-2 or more (the broken inputs below).
def _vision_bound(depth: int) -> float:
    return 2 * fp32_reorder_bound(4 * 32, 8 * depth + 4)


def _encoder_bound(vae) -> float:
    convs = [m for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    return 2 * fp32_reorder_bound(max(c.weight[0].numel() for c in convs), len(convs) + 3)


@torch.no_grad()
def _check(bundle, references, sizes) -> None:
    from qic.runtime.bundle import Bundle
    from tests.test_qwen_image_21_vae import reference_tokens
    proc, te, vae = references
    b = Bundle(bundle)
    settings = b.manifest["conditions"]["processor"]
    vcfg = VisionConfig.from_dict(te.config.to_dict())
    for i, (h, w) in enumerate(sizes):
        picture = _picture(*PICTURES[i], seed=i)
        # VAE side: the pipeline's resize (RGBA kept), then the encoder at the posterior's mode, normalised, packed
        px = condition_pixels(picture, h, w)
        (tokens,) = b.graph("vae_encoder", (h, w))(px)
        want = reference_tokens(vae, px)
        err, bound = rel_l2(tokens, want), _encoder_bound(vae)
        assert tokens.shape == want.shape == (1, (h // 16) * (w // 16), vae.config.z_dim)
        assert err <= bound, f"vae_encoder@{h}x{w}: rel-L2 {err:.3g} > {bound:.3g}"
        # broken on purpose: the alpha dropped (RGB over white, the vision side's copy) is far off
        rgb = condition_pixels(vision_image(picture, h, w), h, w)
        assert rel_l2(b.graph("vae_encoder", (h, w))(rgb)[0], want) > 100 * bound
        # vision side: the copy composited over white, the processor's resize, normalisation and patches
        seen = vision_image(picture, h, w)
        ref = proc(images=[seen], return_tensors="pt")
        grid = tuple(ref["image_grid_thw"][0, 1:].tolist())
        assert grid == (h // 16, w // 16)
        embeds, deep = b.graph("vision", (h, w))(vision_pixels(seen, grid, vcfg.patch_size, settings["image_mean"],
                                                                settings["image_std"]))
        out = te.model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"])
        w_deep = torch.stack(out.deepstack_features)
        assert embeds.shape == out.pooler_output.shape and deep.shape == w_deep.shape
        err, bound = max(rel_l2(embeds, out.pooler_output), rel_l2(deep, w_deep)), _vision_bound(vcfg.depth)
        assert err <= bound, f"vision@{h}x{w}: rel-L2 {err:.3g} > {bound:.3g}"
        # broken on purpose: the processor class's default normalisation (CLIP's) instead of the checkpoint's
        clip = b.graph("vision", (h, w))(vision_pixels(seen, grid, vcfg.patch_size, CLIP_MEAN, CLIP_STD))
        assert rel_l2(clip[0], out.pooler_output) > 100 * bound
        print(f"{h}x{w}: vae_encoder rel-L2 {rel_l2(tokens, want):.2e}, vision {err:.2e} (bound {bound:.1e})")


@pytest.mark.slow
def test_export_bundle_holds_each_sizes_graphs_and_reads_images_as_the_pipeline(cond_export, references):
    bundle, out = cond_export
    manifest = json.loads((bundle / "manifest.json").read_text())
    names = {g["name"] for g in manifest["graphs"]}
    assert names >= {f"{c}@{h}x{w}" for c in ("vision", "vae_encoder") for h, w in SIZES}, names
    assert manifest["components"][-2:] == ["vision", "vae_encoder"]
    cond = manifest["conditions"]
    assert cond["sizes"] == [list(s) for s in SIZES] and cond["images"] == 2
    assert cond["processor"]["min_pixels"] == 65536 and cond["processor"]["patch_size"] == 16
    _check(bundle, references, SIZES)


@pytest.mark.slow
def test_compiled_condition_graphs_read_images_as_the_pipeline(cond_inductor, references):
    bundle, out = cond_inductor
    _check(bundle, references, SIZES[:1])


@pytest.mark.parametrize("args,message", [
    (["--condition-size", "250x256"], "multiples of 32"),
    (["--condition-size", "128x256"], "resizes it to"),   # 32768 px: below the processor's 65536, scaled up
    (["--condition-images", "2"], "needs condition_sizes"),
    (["--components", "text_encoder,vision"], "names no condition_sizes"),
])
def test_condition_flags_refused_in_one_line(q21_ckpt, tmp_path, args, message):
    r = qic("build", "--model", q21_ckpt, "--output", tmp_path / "b", "--cache-dir", tmp_path / "c",
            "--resolution", "64x64", "--text-buckets", Q21_BUCKET, *args, check=False)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert not (tmp_path / "b").exists()


def test_a_qwen_image_build_refuses_condition_sizes(tiny_ckpt, tmp_path):
    r = qic("build", "--model", tiny_ckpt, "--output", tmp_path / "b", "--condition-size", "256x256", check=False)
    assert r.returncode == 2 and "takes no condition images" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ images end to end

@pytest.fixture(scope="module")
def pipe(q21_ckpt):
    """diffusers' QwenImage21Pipeline with transformers' own processor (images-only: no video part)."""
    from tests.qwen_image_21_checkpoint import load_images_pipeline
    pipe = load_images_pipeline(q21_ckpt)
    setattr(pipe, MEMO, {})   # its images, by the arguments: the same in every test that asks
    return pipe


def _pictures(n: int) -> list[Image.Image]:
    return [_picture(*PICTURES[i], seed=10 + i) for i in range(n)]


def _reference(pipe, images, negative=NEGATIVE, use_kv_cache=True, seed=SEED):
    """The pipeline's image. The module's pipe (never changed) computes it once for each set of arguments; a pipeline
    made elsewhere always runs."""
    kw = dict(negative_prompt=negative, true_cfg_scale=GUIDANCE) if negative else {}
    return memoised(pipe, (picture_key(*images), negative, use_kv_cache, seed), lambda: pipe(
        PROMPT, image=images, height=Q21_SIZE[0], width=Q21_SIZE[1], output_resolution=OUTPUT_RESOLUTION,
        num_inference_steps=STEPS, use_kv_cache=use_kv_cache, generator=torch.Generator().manual_seed(seed),
        **kw).images[0])


def _ours(bundle, images, negative=NEGATIVE, kv_cache=None, seed=SEED):
    from qic.models.qwen_image_21.host import Request, generate
    from qic.runtime.bundle import Bundle
    b = Bundle(bundle) if isinstance(bundle, (str, os.PathLike)) else bundle
    req = Request(PROMPT, negative_prompt=negative, guidance=GUIDANCE if negative else None, seed=seed, steps=STEPS,
                  height=Q21_SIZE[0], width=Q21_SIZE[1], image=images, output_resolution=OUTPUT_RESOLUTION,
                  kv_cache=kv_cache)
    return generate(b, req).image


def _within(a, b) -> bool:
    mx, mean = image_diff(a, b)
    print(f"max {mx:.0f}/255, mean {mean:.4f}")
    return mx <= MAX_PIXEL and mean <= MEAN_PIXEL


@pytest.mark.slow
def test_one_condition_image_draws_the_pipelines_image(cond_export, cond_inductor, pipe):
    images = _pictures(1)
    ref = _reference(pipe, images)
    for bundle in (cond_export[0], cond_inductor[0]):
        assert _within(_ours(bundle, images), ref)
    # the bound can fail: the pipeline's image with another picture is outside it
    assert not _within(_ours(cond_export[0], [_picture(*PICTURES[0], seed=99)]), ref)


@pytest.mark.slow
def test_two_images_of_different_aspect_and_no_kv_cache(cond_export, pipe):
    images = _pictures(2)
    ref = _reference(pipe, images)
    assert _within(_ours(cond_export[0], images), ref)
    assert _within(_ours(cond_export[0], images, kv_cache=False), _reference(pipe, images, use_kv_cache=False))
    # the order of the images is part of the prompt: swapped, the image leaves the bound
    assert not _within(_ours(cond_export[0], images[::-1]), ref)


@pytest.mark.slow
def test_broken_variants_leave_the_bound(cond_export, pipe, monkeypatch):
    """Condition latents left out (zeros), an image block's boundary moved by one token in the mask, a stale prefix
    (another picture's K/V at the decode steps): each leaves the bound the right run holds."""
    from qic.models.qwen_image_21 import host
    from qic.runtime.bundle import Bundle
    from tests.helpers import DecodePrefix
    images = _pictures(2)
    ref = _reference(pipe, images)
    b = Bundle(cond_export[0])
    assert _within(_ours(b, images), ref)

    real_encode = host.encode_conditions

    def no_latents(*args):
        c = real_encode(*args)
        c.latents = torch.zeros_like(c.latents)
        return c
    monkeypatch.setattr(host, "encode_conditions", no_latents)
    assert not _within(_ours(b, images), ref)
    monkeypatch.setattr(host, "encode_conditions", real_encode)

    real_inputs = host.prefix_inputs

    def moved_boundary(*args, **kw):
        index, block_ids, key_valid = real_inputs(*args, **kw)
        first = int((block_ids == 1).nonzero()[0])   # the second image's first token joins the first image's block
        block_ids = block_ids.clone()
        block_ids[first] = 0
        return index, block_ids, key_valid
    monkeypatch.setattr(host, "prefix_inputs", moved_boundary)
    assert not _within(_ours(b, images), ref)
    monkeypatch.setattr(host, "prefix_inputs", real_inputs)

    stale = {}

    def keep(k, v):   # the first run's K/V kept, then handed to the second run's decode steps
        stale.setdefault("kv", (k, v))
        return stale["kv"]
    _ours(DecodePrefix(b, keep), [_picture(*PICTURES[0], seed=99), images[1]], negative=None)
    assert not _within(_ours(DecodePrefix(b, keep), images, negative=None), _reference(pipe, images, negative=None))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--tp", 2), ("--cfg-parallel",)], ids=["tp2", "cfg-parallel"])
def test_two_images_on_two_ranks(shared_dir, cache_dir, q21_ckpt, pipe, tmp_path, layout):
    """TP 2 (the text encoder and the denoiser sharded) and CFG-parallel (each CFG group encodes the images and runs
    its own branch's prefix), through qic run's ranks."""
    sizes = [a for s in SIZES for a in ("--condition-size", "{}x{}".format(*s))]
    bundle, _ = _build_q21(shared_dir, cache_dir, q21_ckpt, f"bundle-q21-cond-{'-'.join(map(str, layout))}",
                           "--backend", "export", *layout, *sizes, "--condition-images", 2)
    paths = []
    for i, picture in enumerate(_pictures(2)):
        paths.append(tmp_path / f"cond{i}.png")
        picture.save(paths[-1])
    png = tmp_path / "out.png"
    qic("run", bundle, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE, "--seed", SEED,
        "--steps", STEPS, "--height", Q21_SIZE[0], "--width", Q21_SIZE[1], "--output-resolution", OUTPUT_RESOLUTION,
        *[a for p in paths for a in ("--image", p)], "--output", png)
    assert _within(Image.open(png), _reference(pipe, [Image.open(p) for p in paths]))


@pytest.mark.slow
def test_bad_images_are_refused_in_one_line_and_nothing_is_written(cond_export, q21_bundle, bundle, tmp_path):
    good = tmp_path / "good.png"
    _picture(*PICTURES[0], seed=1).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:200])
    wide = tmp_path / "wide.png"
    _picture(200, 600, seed=2).save(wide)   # 3:1 resizes to 192x544 at 320: no built size
    out = tmp_path / "out.png"
    base = ["--prompt", PROMPT, "--steps", 1, "--output-resolution", OUTPUT_RESOLUTION, "--output", out]
    for target, images, message in (
            (cond_export[0], [truncated], "truncated.png: not a readable image"),
            (cond_export[0], [tmp_path / "missing.png"], "missing.png: condition image not found"),
            (cond_export[0], [good, good, good], "3 condition images; this bundle takes at most 2"),
            (cond_export[0], [wide], "holds condition sizes 320x320, 288x352"),
            (q21_bundle, [good], "built without condition images")):
        r = qic("run", target, *base, *[a for p in images for a in ("--image", p)], check=False)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) <= 2 and not out.exists()
    # --nearest-condition-size fits the wide picture to the nearest built size instead; the PNG says so
    qic("run", cond_export[0], *base, "--height", Q21_SIZE[0], "--width", Q21_SIZE[1], "--image", wide,
        "--nearest-condition-size", "--steps", 2)
    assert Image.open(out).text["conditions"] == "288x352 (image 1: 192x544 -> 288x352)"
    out.unlink()
    # a prompts-file line's image: a path or a list of paths, nothing else
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(json.dumps({"prompt": PROMPT, "image": 3}) + "\n")
    r = qic("run", cond_export[0], "--prompts-file", lines, check=False)
    assert r.returncode == 2 and "image must be an image file path or a list of them" in r.stderr, r.stderr
    # on a Qwen-Image text-to-image bundle --image is img2img's, which needs the VAE encoder this one lacks: refused
    # naming it, never dropped
    r = qic("run", bundle, "--prompt", PROMPT, "--image", good, "--output", out, check=False)
    assert r.returncode == 2 and "needs the VAE encoder" in r.stderr and not out.exists(), r.stderr


@pytest.mark.slow
def test_served_reference_images_are_the_png_qic_run_writes(cond_export, tmp_path):
    """A 2.1 bundle built with condition sizes takes its reference images through POST /v1/images/edits (the openai
    client's images.edit, two images as image[]), its own program reading them: `qic run`'s PNG byte for byte (the
    pictures fitted to the nearest built size at the default output_resolution, on both)."""
    import base64

    from openai import OpenAI

    from tests.test_serve import ServeProcess
    paths = []
    for i, picture in enumerate(_pictures(2)):
        paths.append(tmp_path / f"cond{i}.png")
        picture.save(paths[-1])
    settings = {"negative_prompt": NEGATIVE, "guidance": GUIDANCE, "seed": SEED, "steps": STEPS}
    srv = ServeProcess(cond_export[0], tmp_path / "serve.log")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
            resp = client.images.edit(image=[a, b], prompt=PROMPT, size="{1}x{0}".format(*Q21_SIZE),
                                      extra_body={**settings, "nearest_condition_size": True})
    finally:
        srv.close()
    png = tmp_path / "run.png"
    qic("run", cond_export[0], "--prompt", PROMPT, *[a for p in paths for a in ("--image", p)],
        "--nearest-condition-size", "--height", Q21_SIZE[0], "--width", Q21_SIZE[1],
        *[a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", v)], "--output", png)
    assert base64.b64decode(resp.data[0].b64_json) == png.read_bytes()
