"""Issue 31: Qwen-Image-Edit-2509 / -2511 (diffusers' QwenImageEditPlusPipeline) as a bundle: `qic build --model
EDIT_CHECKPOINT --condition-size HxW` adds the vision tower and the VAE encoder per condition size and builds the
images forms of the text encoder and the step (qic/models/qwen_image/graphs.py), and `qic run BUNDLE --image A.png`
edits through the family's edit program (qic/models/qwen_image/host) as the pipeline does.

The checkpoint is tests/qwen_image_edit_checkpoint.py's (the tiny preset's configs in the hub's layout, a saved
processor, a vision tower of depth 2 with a window block and a full-attention block, GQA text encoder). The pipeline
resizes every condition image to 1024*1024 pixels on the VAE side, which the tiny model would run slowly; the
reference runs with that area patched down to 96*64 (VAE_IMAGE_SIZE, a module constant of the pipeline), and qic,
whose bundles hold the pipeline's sizes, is asked for the nearest built size (--nearest-condition-size), which at the
pictures' exact aspects is the size the patched reference computes. The vision side stays the pipeline's 384*384.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import TINY_RES, _build, image_diff, made_once, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL, MEMO, memoised, picture_key

pytestmark = pytest.mark.slow   # every test builds a bundle (the export back end: tracing, no C++) or runs diffusers

REFERENCE_VAE_AREA = 96 * 64            # the reference pipeline's VAE side (module docstring)
SIZES = ((64, 64), (64, 96))            # the built condition sizes: a square and a 3:2 picture at that area
PICTURES = ((80, 80), (80, 120))        # (height, width) of the pictures given: SIZES' aspects, another size
OUTPUT = TINY_RES                       # the session's tiny bundles' size: their decoder graph, a cache hit
STEPS, SEED, PROMPT, NEGATIVE, GUIDANCE = 3, 7, "make the circle red", "blurry", 4.0
BUCKET = 256                            # the edit template with two pictures and the prompt fit (image tokens aside)


def _picture(h: int, w: int, seed: int) -> Image.Image:
    """Smooth colour fields plus noise: both the tower's and the encoder's inputs carry every frequency."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    rgb = np.stack([np.sin(7 * x + seed), np.cos(5 * y - seed), np.sin(3 * (x + y))], -1) * 90 + 128
    return Image.fromarray(np.clip(rgb + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8), "RGB")


def _pictures(n: int, seed: int = 10) -> list[Image.Image]:
    return [_picture(*PICTURES[i], seed=seed + i) for i in range(n)]


@pytest.fixture(scope="module")
def edit_ckpt(shared_dir) -> Path:
    from tests.qwen_image_edit_checkpoint import write_checkpoint
    return Path(made_once(shared_dir, "ckpt-edit", lambda out: str(write_checkpoint(out))))


@pytest.fixture(scope="module")
def edit_2511_ckpt(shared_dir) -> Path:
    from tests.qwen_image_edit_checkpoint import write_checkpoint
    return Path(made_once(shared_dir, "ckpt-edit-2511", lambda out: str(write_checkpoint(out, zero_cond_t=True))))


def _build_edit(shared_dir, cache_dir, ckpt, name, *args, sizes=SIZES):
    flags = [a for s in sizes for a in ("--condition-size", "{}x{}".format(*s))]
    return _build(shared_dir, name, "--model", ckpt, "--cache-dir", cache_dir, "--resolution", "{}x{}".format(*OUTPUT),
                  "--text-buckets", BUCKET, *flags, "--condition-images", len(sizes), *args)[0]


@pytest.fixture(scope="module")
def edit_export(shared_dir, cache_dir, edit_ckpt) -> Path:
    """Two condition sizes, two images a request, the export back end (the graphs' contract, nothing compiled)."""
    return _build_edit(shared_dir, cache_dir, edit_ckpt, "bundle-edit-export", "--backend", "export")


@pytest.fixture(scope="module")
def pipe(edit_ckpt):
    from tests.qwen_image_edit_checkpoint import load_pipeline
    pipe = load_pipeline(edit_ckpt)
    setattr(pipe, MEMO, {})   # its edits, by (pictures, negative): the same in every test that asks
    return pipe


def _reference(pipe, images, negative=NEGATIVE, memo=True):
    """The pipeline's edit. The module's `pipe` computes each once (memo=False while its weights are changed);
    a pipeline made in a test always runs."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    kw = dict(negative_prompt=negative, true_cfg_scale=GUIDANCE) if negative else {}

    def draw():
        with mock.patch.object(plus, "VAE_IMAGE_SIZE", REFERENCE_VAE_AREA):
            return pipe(image=images, prompt=PROMPT, height=OUTPUT[0], width=OUTPUT[1], num_inference_steps=STEPS,
                        generator=torch.Generator().manual_seed(SEED), **kw).images[0]
    return memoised(pipe, (picture_key(*images), negative), draw) if memo else draw()


def _ours(bundle, images, negative=NEGATIVE):
    from qic.models.qwen_image.host import Request, generate
    from qic.runtime.bundle import Bundle
    b = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    req = Request(PROMPT, negative_prompt=negative, guidance=GUIDANCE if negative else None, seed=SEED, steps=STEPS,
                  height=OUTPUT[0], width=OUTPUT[1], image=images, nearest_condition_size=True)
    return generate(b, req).image


def _within(a, b) -> bool:
    mx, mean = image_diff(a, b)
    print(f"max {mx:.0f}/255, mean {mean:.4f}")
    return mx <= MAX_PIXEL and mean <= MEAN_PIXEL


def test_one_image_edits_as_the_pipeline(edit_export, pipe):
    images = _pictures(1)
    ref = _reference(pipe, images)
    assert _within(_ours(edit_export, images), ref)
    # the bound can fail: another picture's edit is outside it
    assert not _within(_ours(edit_export, _pictures(1, seed=99)), ref)


def test_previews_follow_every_step_and_end_at_the_image(edit_export):
    """The edit program's previews (qic serve's partial images)."""
    from qic.models.qwen_image.host import Request, generate
    from qic.runtime.bundle import Bundle
    from tests.helpers import check_previews
    req = Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE, seed=SEED, steps=STEPS, height=OUTPUT[0],
                  width=OUTPUT[1], image=_pictures(1), nearest_condition_size=True)
    check_previews(lambda previews: generate(Bundle(edit_export), req, previews))


def test_two_images_of_different_aspect(edit_export, pipe):
    images = _pictures(2)
    ref = _reference(pipe, images)
    assert _within(_ours(edit_export, images), ref)
    # the pictures' order is the prompt's ("Picture 1", "Picture 2") and the frames': swapped, the image leaves it
    assert not _within(_ours(edit_export, images[::-1]), ref)
    # without CFG (no negative prompt): the CFG graph at guidance 1, as the pipeline's single prediction
    assert _within(_ours(edit_export, images, negative=None), _reference(pipe, images, negative=None))
    # without --height/--width the output follows the last image (832x1248 here): not built, refused naming why
    from qic.errors import ConfigError
    from qic.models.qwen_image.host import Request, generate
    from qic.runtime.bundle import Bundle
    with pytest.raises(ConfigError, match="follows the last image's aspect at 1024.1024 pixels, 832x1248"):
        generate(Bundle(edit_export), Request(PROMPT, image=images, nearest_condition_size=True))


def test_a_model_that_records_its_own_condition_areas(shared_dir, cache_dir, edit_ckpt, tmp_path):
    """A checkpoint whose model_index.json records its own areas (`_qic_condition_areas`, as the trained
    embedded:shapes-edit does) is sized at them with no flag: VAE side and vision side at 96*64 pixels (the vision
    grids of its graphs too) and the output at the last picture's aspect at 96*64, 64x96 here; the reference is the
    pipeline with both its area constants patched to those (and the output size given: its default's area is a third
    constant). At the pipeline's own areas the same pictures are refused (1024*1024 is no built size)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from tests.qwen_image_edit_checkpoint import load_pipeline
    ckpt = tmp_path / "ckpt"
    shutil.copytree(edit_ckpt, ckpt)
    index = json.loads((ckpt / "model_index.json").read_text())
    areas = {"vae": REFERENCE_VAE_AREA, "vision": REFERENCE_VAE_AREA}
    (ckpt / "model_index.json").write_text(json.dumps(index | {"_qic_condition_areas": areas}))
    common = ["--cache-dir", cache_dir, "--text-buckets", BUCKET, "--resolution", "64x96", "--condition-images", 2,
              "--backend", "export", *(a for s in SIZES for a in ("--condition-size", "{}x{}".format(*s)))]
    qic("build", "--model", ckpt, *common, "--output", tmp_path / "own")
    manifest = json.loads((tmp_path / "own" / "manifest.json").read_text())
    assert manifest["conditions"]["areas"] == [REFERENCE_VAE_AREA, REFERENCE_VAE_AREA]
    paths = []
    for i, img in enumerate(_pictures(2)):
        paths += ["--image", tmp_path / f"in{i}.png"]
        img.save(tmp_path / f"in{i}.png")
    settings = ["--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE, "--seed", SEED, "--steps",
                STEPS]
    qic("run", tmp_path / "own", *settings, *paths, "--output", tmp_path / "own.png")
    ref_pipe = load_pipeline(ckpt)
    ref_pipe.set_progress_bar_config(disable=True)

    def reference(vision_area: int):
        with mock.patch.object(plus, "VAE_IMAGE_SIZE", REFERENCE_VAE_AREA), \
                mock.patch.object(plus, "CONDITION_IMAGE_SIZE", vision_area):
            return ref_pipe(image=_pictures(2), prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE,
                            height=64, width=96, num_inference_steps=STEPS,
                            generator=torch.Generator().manual_seed(SEED)).images[0]
    ours = Image.open(tmp_path / "own.png")
    assert ours.size == (96, 64) and _within(ours, reference(REFERENCE_VAE_AREA))
    # the vision side at the pipeline's 384*384 instead (the record's vision area ignored): outside the bound
    assert not _within(ours, reference(plus.CONDITION_IMAGE_SIZE))
    # the same pictures on a bundle of the same sizes at the pipeline's areas: refused, naming the size they take
    qic("build", "--model", edit_ckpt, *common, "--output", tmp_path / "theirs")
    r = qic("run", tmp_path / "theirs", *settings, *paths, "--output", tmp_path / "no.png", check=False)
    assert r.returncode == 2 and "resizes to 1024x1024" in r.stderr and not (tmp_path / "no.png").exists(), r.stderr


def test_broken_variants_leave_the_bound(edit_export, pipe, monkeypatch):
    """Condition latents left out (zeros), the condition images at the output's RoPE frame (0), the vision features
    left out of the prompt: each leaves the bound the right run holds."""
    from qic.models.qwen_image import host
    from qic.runtime.bundle import Bundle
    images = _pictures(2)
    ref = _reference(pipe, images)
    b = Bundle(edit_export)
    assert _within(_ours(b, images), ref)

    real_encode = host._encode_images

    def zeroed(field):   # the encoded images with one of their parts left out
        def encode(*args):
            c = real_encode(*args)
            setattr(c, field, torch.zeros_like(getattr(c, field)))
            return c
        return encode
    for field in ("latents", "embeds"):
        monkeypatch.setattr(host, "_encode_images", zeroed(field))
        assert not _within(_ours(b, images), ref), field
    monkeypatch.setattr(host, "_encode_images", real_encode)

    real_positions = host.rope_positions

    def frame_zero(height, width, txt_len, conditions=()):
        pos = real_positions(height, width, txt_len, conditions).clone()
        pos[txt_len:, 0] = 0     # every image at the output's frame
        return pos
    monkeypatch.setattr(host, "rope_positions", frame_zero)
    assert not _within(_ours(b, images), ref)


def test_zero_cond_t_2511(shared_dir, cache_dir, edit_2511_ckpt, tmp_path):
    """Edit-2511 (the transformer's zero_cond_t: condition tokens modulated at t = 0) edits as the pipeline does;
    the same weights with the flag off in the config (what ignoring it draws) leave the bound."""
    from tests.qwen_image_edit_checkpoint import load_pipeline
    bundle = _build_edit(shared_dir, cache_dir, edit_2511_ckpt, "bundle-edit-2511-export", "--backend", "export")
    images = _pictures(1)
    ref = _reference(load_pipeline(edit_2511_ckpt), images)
    assert _within(_ours(bundle, images), ref)
    ignored = tmp_path / "ckpt"
    shutil.copytree(edit_2511_ckpt, ignored)
    config = json.loads((ignored / "transformer" / "config.json").read_text())
    (ignored / "transformer" / "config.json").write_text(json.dumps({**config, "zero_cond_t": False}))
    off = _build_edit(tmp_path, cache_dir, ignored, "bundle", "--backend", "export")
    assert not _within(_ours(off, images), ref)


def test_qwen_image_edit_v1(shared_dir, cache_dir, tmp_path):
    """Qwen-Image-Edit (QwenImageEditPipeline): one image, inline in its template, the processor handed the VAE-side
    image, as the pipeline edits (its area patched down like the Plus reference's: its calculate_dimensions, whose
    1024*1024 is a literal in its __call__). The Plus template on the same weights (what a build that took an Edit
    checkpoint for an Edit Plus one would run) leaves the bound; a second image is refused at build."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as v1

    from qic.models.qwen_image import host
    from tests.qwen_image_edit_checkpoint import load_pipeline, write_checkpoint
    ckpt = Path(made_once(shared_dir, "ckpt-edit-v1",
                          lambda out: str(write_checkpoint(out, pipeline="QwenImageEditPipeline"))))
    bundle = _build_edit(shared_dir, cache_dir, ckpt, "bundle-edit-v1-export", "--backend", "export",
                         sizes=SIZES[:1])
    images = _pictures(1)
    real = v1.calculate_dimensions
    with mock.patch.object(v1, "calculate_dimensions", lambda area, ratio: real(REFERENCE_VAE_AREA, ratio)):
        ref = load_pipeline(ckpt)(image=images[0], prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE,
                                  height=OUTPUT[0], width=OUTPUT[1], num_inference_steps=STEPS,
                                  generator=torch.Generator().manual_seed(SEED)).images[0]
    assert _within(_ours(bundle, images), ref)
    real_text = host.edit_prompt_text
    with mock.patch.object(host, "edit_prompt_text", lambda p, n, plus=True: real_text(p, n, True)):
        assert not _within(_ours(bundle, images), ref)
    r = qic("build", "--model", ckpt, "--output", tmp_path / "b", "--condition-images", 2, "--resolution", "64x64",
            check=False)
    assert r.returncode == 2 and "reads one condition image" in r.stderr, r.stderr


def test_compiled_edit_bundle_through_the_cli(shared_dir, cache_dir, edit_ckpt, pipe, tmp_path):
    """A bundle of one condition size as a user runs it, `qic run BUNDLE --image A.png`; the PNG records the size
    used. Refused in one line each, nothing written: an unbuilt size without --nearest-condition-size, more images
    than built for, a missing file. The export back end: the edit kinds of graph are compiled by inductor once, in
    `make edit`'s build (tests/test_shapes_edit_model.py: its CPU target, and qic run against diffusers), so these
    sensitive random weights check the host program, the graphs' contract and the refusals."""
    bundle = _build_edit(shared_dir, cache_dir, edit_ckpt, "bundle-edit-one-export", "--backend", "export",
                         sizes=SIZES[:1])
    graphs = json.loads((bundle / "manifest.json").read_text())["graphs"]
    assert {g["name"].split("@")[0] for g in graphs} >= {"vision", "vae_encoder"}
    images = _pictures(1)
    images[0].save(tmp_path / "in0.png")
    paths = ["--image", tmp_path / "in0.png"]
    out = tmp_path / "out.png"
    common = ["run", bundle, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE, "--seed", SEED,
              "--steps", STEPS, "--height", OUTPUT[0], "--width", OUTPUT[1]]
    qic(*common, *paths, "--nearest-condition-size", "--output", out)
    got = Image.open(out)
    assert _within(got, _reference(pipe, images))
    assert got.text["conditions"] == "64x64 (image 1: 1024x1024 -> 64x64)"
    for args, message in [(paths, "--nearest-condition-size"),
                          (paths * 2, "takes at most 1"),
                          (["--image", tmp_path / "missing.png"], "missing.png: condition image not found")]:
        bad = tmp_path / "bad.png"
        r = qic(*common, *args, "--output", bad, check=False)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
        assert not bad.exists()


@pytest.mark.parametrize("args,message", [
    (["--condition-size", "64x64", "--batch-sizes", "1,2"], "--batch-sizes other than 1: not yet"),
    (["--condition-size", "64x64", "--step-cache", "1,0"], "step caching: not yet"),
    (["--condition-size", "48x64"], "multiples of 32"),
])
def test_edit_build_flags_refused_in_one_line(edit_ckpt, tmp_path, args, message):
    r = qic("build", "--model", edit_ckpt, "--output", tmp_path / "b", "--cache-dir", tmp_path / "c",
            "--resolution", "64x64", "--text-buckets", BUCKET, *args, check=False)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert not (tmp_path / "b").exists()


def test_served_edit_is_the_png_qic_run_writes(edit_export, tmp_path):
    """POST /v1/images/edits through the openai client's images.edit (two images: image[]), qic's fields in
    extra_body: the PNG `qic run` writes for the same settings, byte for byte. An image that is no picture, a
    generation without images and what the edit program does not take (inpaint's mask, img2img's strength): 400
    naming what is wrong."""
    from openai import BadRequestError, OpenAI

    from tests.test_serve import ServeProcess
    paths = []
    for i, img in enumerate(_pictures(2)):
        paths.append(tmp_path / f"in{i}.png")
        img.save(paths[-1])
    settings = {"negative_prompt": NEGATIVE, "steps": STEPS, "guidance": GUIDANCE, "seed": SEED}
    srv = ServeProcess(edit_export, tmp_path / "serve.log")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
            resp = client.images.edit(image=[a, b], prompt=PROMPT, size="{1}x{0}".format(*OUTPUT),
                                      response_format="b64_json",
                                      extra_body={**settings, "nearest_condition_size": True})
        served = base64.b64decode(resp.data[0].b64_json)
        (tmp_path / "junk.png").write_bytes(b"not a picture")
        for files, message in [({"image": open(tmp_path / "junk.png", "rb")}, "is not a readable image"),
                               ({"image": open(paths[0], "rb"), "mask": open(paths[1], "rb")},
                                "mask: this model's runs take no such option")]:
            with pytest.raises(BadRequestError, match=message):
                client.images.edit(**files, prompt=PROMPT)
        with pytest.raises(BadRequestError, match="needs a condition image"):
            client.images.generate(prompt=PROMPT, size="{1}x{0}".format(*OUTPUT))
        with pytest.raises(BadRequestError, match="strength: this model's runs take no such option"):   # img2img's
            client.images.edit(image=open(paths[0], "rb"), prompt=PROMPT, extra_body={"strength": 0.5})
    finally:
        srv.close()
    out = tmp_path / "run.png"
    qic("run", edit_export, "--prompt", PROMPT, *(a for p in paths for a in ("--image", p)), "--nearest-condition-size",
        "--height", OUTPUT[0], "--width", OUTPUT[1], *(a for k, v in settings.items()
                                                       for a in (f"--{k.replace('_', '-')}", v)), "--output", out)
    assert served == out.read_bytes()


def test_edits_on_a_bundle_that_reads_no_image_are_refused(bundle_two_res, tmp_path):
    """A text-to-image bundle built without the VAE encoder answers /v1/images/edits 400 naming what it lacks."""
    from openai import BadRequestError, OpenAI

    from tests.test_serve import ServeProcess
    srv = ServeProcess(bundle_two_res[0], tmp_path / "serve.log")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(BadRequestError, match="needs the VAE encoder"):
            client.images.edit(image=_png_bytes(_picture(32, 32, 0)), prompt=PROMPT)
    finally:
        srv.close()


def _png_bytes(img: Image.Image) -> tuple[str, bytes, str]:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return ("picture.png", buf.getvalue(), "image/png")


def test_tp2_and_tp2_cfg2_edits_draw_the_tp1_image(shared_dir, cache_dir, edit_ckpt, edit_export, tmp_path):
    """The edit bundle at TP 2 (vision tower and VAE encoder replicated, the text encoder and denoiser sharded) and
    at TP 2 x CFG-parallel 2, through `qic run` (their ranks spawned): TP 1's image within the bound."""
    paths = []
    for i, img in enumerate(_pictures(2)):
        paths += ["--image", tmp_path / f"in{i}.png"]
        img.save(tmp_path / f"in{i}.png")
    images = {}
    for name, bundle in [("tp1", edit_export),
                         ("tp2", _build_edit(shared_dir, cache_dir, edit_ckpt, "bundle-edit-tp2-export", "--backend",
                                             "export", "--tp", 2)),
                         ("tp2-cfg2", _build_edit(shared_dir, cache_dir, edit_ckpt, "bundle-edit-tp2-cfgp-export",
                                                  "--backend", "export", "--tp", 2, "--cfg-parallel"))]:
        qic("run", bundle, "--prompt", PROMPT, *paths, "--nearest-condition-size", "--negative-prompt", NEGATIVE,
            "--guidance", GUIDANCE, "--seed", SEED, "--steps", STEPS, "--height", OUTPUT[0], "--width", OUTPUT[1],
            "--output", tmp_path / f"{name}.png")
        images[name] = Image.open(tmp_path / f"{name}.png")
    assert _within(images["tp2"], images["tp1"]) and _within(images["tp2-cfg2"], images["tp1"])


def test_edit_graphs_lower_check_and_run_on_xla_cpu(edit_ckpt, pipe, neuron_cache, tmp_path):
    """The neuron back end (its lowering half, torch-xla in .venv-xla): every edit graph (vision tower, VAE encoder,
    the text encoder's and the step's images forms, the decoder) lowered and checked on XLA:CPU against eager at
    TP 1 and TP 2 (collectives checked at both ranks; the decoder's lowering the session neuron bundle's, one
    cache); `qic run --device xla-cpu` edits as the pipeline does."""
    from tests.test_neuron_xla import xla_qic
    paths = []
    for i, img in enumerate(_pictures(1)):
        paths += ["--image", tmp_path / f"in{i}.png"]
        img.save(tmp_path / f"in{i}.png")
    common = ["--backend", "neuron", "--model", edit_ckpt, "--resolution", "{}x{}".format(*OUTPUT), "--text-buckets",
              BUCKET, "--condition-size", "{}x{}".format(*SIZES[0]), "--cache-dir", neuron_cache]
    for tp in (1, 2):
        proc = xla_qic("build", *common, "--tp", tp, "--output", tmp_path / f"tp{tp}")
        assert "5 of 5 graphs executed on XLA:CPU and matched eager PyTorch" in proc.stdout + proc.stderr, proc.stdout
    xla_qic("run", tmp_path / "tp1", "--device", "xla-cpu", "--prompt", PROMPT, *paths, "--nearest-condition-size",
            "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE, "--seed", SEED, "--steps", STEPS,
            "--height", OUTPUT[0], "--width", OUTPUT[1], "--output", tmp_path / "xla.png")
    assert _within(Image.open(tmp_path / "xla.png"), _reference(pipe, _pictures(1)))


def test_an_edit_plus_build_defaults_to_the_seven_aspects_and_three_images(edit_ckpt):
    """Without --condition-size an Edit Plus build holds the seven aspect presets' shapes at the pipeline's VAE-side
    area (the family record's list, checked here against the sizing the edit program applies to an image of each
    aspect), up to three images a request; the default build's graphs: per condition size a vision tower and a VAE
    encoder, beside a text-to-image build's (docs/design.md counts them)."""
    from qic.host.aspect import PRESETS
    from qic.models.qwen_image.family import FAMILY
    from qic.models.qwen_image.host.conditions import vae_side
    from qic.spec import parse_spec
    sizes, images = FAMILY.condition_defaults["QwenImageEditPlusPipeline"]
    assert list(sizes) == [vae_side(h, w) for h, w in PRESETS.values()] and images == 3
    spec = parse_spec({"model": str(edit_ckpt), "resolutions": ["64x64"], "text_buckets": [BUCKET]})
    assert spec.condition_sizes == sizes and spec.condition_images == 3
    assert spec.components[-2:] == ("vision", "vae_encoder")
    # a count given, the sizes default; sizes given, the count defaults to the class's
    assert parse_spec({"model": str(edit_ckpt), "condition_images": 2}).condition_sizes == sizes
    assert parse_spec({"model": str(edit_ckpt), "condition_sizes": ["64x64"]}).condition_images == 3


def test_an_edit_lora_merges_as_diffusers_fuses_it(shared_dir, cache_dir, edit_ckpt, pipe, tmp_path):
    """`qic build --lora FILE:SCALE` on an edit build merges into the denoiser as QwenImageEditPlusPipeline's
    load_lora_weights + fuse_lora: the edit within the bound; without the LoRA, outside it. The edit denoiser's module
    names are the text-to-image one's, so the file layouts Edit LoRAs are published in (PEFT / diffusers, kohya,
    ComfyUI-style diffusion_model.) are read as tests/test_lora.py checks each; this one merges the PEFT layout."""
    from tests.test_lora import SCALE, _factors, write_lora
    lora = tmp_path / "edit-lora.safetensors"
    write_lora("peft", _factors(edit_ckpt), lora)
    bundle = _build_edit(shared_dir, cache_dir, edit_ckpt, "bundle-edit-lora-export", "--backend", "export",
                         "--lora", f"{lora}:{SCALE}", sizes=SIZES[:1])
    images = _pictures(1)
    pipe.load_lora_weights(str(lora), adapter_name="edit")
    pipe.fuse_lora(lora_scale=SCALE)
    try:
        ref = _reference(pipe, images, memo=False)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert _within(_ours(bundle, images), ref)
    assert not _within(_reference(pipe, images), ref)


def test_warm_fills_an_edit_matrix_that_a_build_then_hits(edit_ckpt, tmp_path):
    """`qic warm` over a matrix naming an edit checkpoint and its condition sizes at TP 1 and 2 (the export back end:
    the orchestration, nothing compiled) compiles each of the edit graphs once; the TP 2 build after compiles none."""
    import yaml
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump({
        "model": [str(edit_ckpt)], "backend": "export", "tp": [1, 2], "resolutions": ["{}x{}".format(*OUTPUT)],
        "text_buckets": [BUCKET], "condition_sizes": ["{}x{}".format(*SIZES[0])], "condition_images": 1,
        "cache_dir": str(tmp_path / "cache")}))
    out = qic("warm", matrix).stdout
    assert "7 misses (7 compiled, 0 failed)" in " ".join(out.split()), out   # 5 graphs, 2 of them again at TP 2
    build = qic("build", "--model", edit_ckpt, "--backend", "export", "--tp", 2, "--resolution",
                "{}x{}".format(*OUTPUT), "--text-buckets", BUCKET, "--condition-size", "{}x{}".format(*SIZES[0]),
                "--condition-images", 1, "--cache-dir", tmp_path / "cache", "--output", tmp_path / "bundle").stdout
    compiles = [line for line in build.splitlines() if line.startswith("│ compile")]
    assert len(compiles) == 5 and all("│ cached │" in line for line in compiles), build


def test_a_bf16_edit_is_no_worse_than_diffusers_bf16(cache_dir, edit_ckpt, pipe, tmp_path):
    """An edit bundle built with the vision tower, the text encoder and the denoiser in bf16 (the VAE's encoder and
    decoder fp32, as tests/test_bf16_fidelity.py builds text-to-image) lands no further from the fp32 pipeline's image
    than diffusers' pipeline with those modules in bf16 (its VAE fp32 too: the pipeline casts the condition pixels to
    the text encoder's dtype before encoding them, so the reference encodes them in fp32 and hands the latents on in
    bf16, as qic's graphs do).

    The checkpoint's matrices are scaled by a quarter (tests/test_bf16_fidelity.py's argument, which halves them: at the
    sensitized draw one bf16 forward is tens of percent off for both and the comparison is noise; the edit chain adds
    the vision tower and its tokens, and halved both images still landed about 11 levels off on average, quartered
    about 1). The export back end runs the graphs' own bf16 arithmetic op by op as eager diffusers does (inductor's
    fusions, which keep pointwise chains in fp32, are tests/test_bf16_fidelity.py's); both errors are bf16 rounding
    noise of one computation in a different order (qic batches the CFG rows, runs its own norms and attention), so
    their means agree up to that spread: qic's at most 1.25x diffusers'. Floor: tests/test_bf16_fidelity.bf16_floor,
    which an fp32 bundle (a build that ignored `dtype`) lands below."""
    from tests.helpers import scaled_checkpoint
    from tests.qwen_image_edit_checkpoint import load_pipeline
    from tests.test_bf16_fidelity import bf16_floor
    quartered = scaled_checkpoint(edit_ckpt, tmp_path / "ckpt", 0.25)
    config = tmp_path / "bf16.yaml"
    config.write_text(json.dumps({
        "model": str(quartered), "dtype": {c: "bfloat16" for c in ("vision", "text_encoder", "denoiser")},
        "backend": "export", "resolutions": ["{}x{}".format(*OUTPUT)], "text_buckets": [BUCKET],
        "condition_sizes": ["{}x{}".format(*SIZES[0])], "condition_images": 1, "output": str(tmp_path / "bundle"),
        "cache_dir": str(cache_dir)}))
    qic("build", config)
    images = _pictures(1)
    ours = _ours(tmp_path / "bundle", images)
    ref_pipe = load_pipeline(quartered)
    ref_pipe.set_progress_bar_config(disable=True)
    reference = _reference(ref_pipe, images)
    ref_pipe.text_encoder.to(torch.bfloat16)
    ref_pipe.transformer.to(torch.bfloat16)
    encode = ref_pipe._encode_vae_image
    with mock.patch.object(ref_pipe, "_encode_vae_image",
                           lambda image, generator: encode(image.float(), generator).to(torch.bfloat16)):
        theirs = _reference(ref_pipe, images)
    ours_max, ours_mean = image_diff(ours, reference)
    theirs_max, theirs_mean = image_diff(theirs, reference)
    floor, _ = bf16_floor(reference)
    print(f"vs diffusers fp32: qic bf16 max {ours_max:.0f} mean {ours_mean:.3f}; diffusers bf16 max {theirs_max:.0f} "
          f"mean {theirs_mean:.3f} (0..255); floor {floor:.3f}")
    assert floor < ours_mean <= 1.25 * theirs_mean
    # the measure can fail: the unscaled model's fp32 edit (another image of the same pictures) is far outside it
    assert image_diff(_reference(pipe, images), reference)[1] > 10 * theirs_mean
