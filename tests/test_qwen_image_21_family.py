"""Qwen-Image-2.1 through qic build / qic run, text to image, against diffusers' QwenImage21Pipeline.

The session's build (tests/conftest.py q21_bundle) of a tiny random 2.1 checkpoint in the real layout
(tests/qwen_image_21_checkpoint.py: diffusers' and transformers' own classes) at 64x64 with one text bucket: four
graphs (text encoder, denoiser prefill and decode, VAE decoder), inductor CPU, fp32. `qic build --model DIR` picks
the family from model_index.json's QwenImage21Pipeline; `qic run` runs the family's own host program (prefill on the
first step, decode after it, the prefix K/V resident per CFG branch) and draws what the pipeline draws on the same
checkpoint, seed and steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from tests.conftest import Q21_BUCKET, Q21_SIZE, ROOT, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL, DecodePrefix, one_line_refusal

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

SIZE, BUCKET, STEPS, SEED = Q21_SIZE, Q21_BUCKET, 3, 7
PROMPT, NEGATIVE, GUIDANCE = "a red circle on a blue background", "a green square", 4.0


@pytest.fixture(scope="module")
def ckpt(q21_ckpt):
    return q21_ckpt


@pytest.fixture(scope="module")
def bundle(q21_bundle):
    return q21_bundle


@pytest.fixture(scope="module")
def pipe(q21_pipe):
    return q21_pipe


def _reference(pipe, prompt=PROMPT, negative=NEGATIVE, seed=SEED, use_kv_cache=True):
    kw = dict(negative_prompt=negative, true_cfg_scale=GUIDANCE) if negative else {}
    return pipe(prompt, height=SIZE[0], width=SIZE[1], num_inference_steps=STEPS, use_kv_cache=use_kv_cache,
                generator=torch.Generator().manual_seed(seed), **kw).images[0]


def _within(a, b) -> bool:
    mx, mean = image_diff(a, b)
    print(f"max {mx:.0f}/255, mean {mean:.4f}")
    return mx <= MAX_PIXEL and mean <= MEAN_PIXEL


def test_build_picks_the_family_and_holds_prefill_and_decode_graphs(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["family"] == {"name": "qwen-image-2.1", "host": "qic.models.qwen_image_21.host"}
    assert [g["name"] for g in m["graphs"]] == ["text_encoder@L64", "denoiser@64x64@L64@prefill",
                                                "denoiser@64x64@L64@decode", "vae_decoder@64x64"]
    assert m["tokenizer"] == "tokenizer" and (bundle / "tokenizer" / "vocab.json").is_file()


@pytest.mark.slow
def test_qic_serve_runs_the_family_program_and_sends_qic_runs_png(bundle, tmp_path):
    """qic serve names no family: it runs the bundle's host program (plan, then generate), so a 2.1 bundle serves
    the PNG `qic run` writes for the same settings, and refuses an option its program does not take by name."""
    import base64

    from qic.serve.client import request
    from tests.test_serve import ServeProcess
    srv = ServeProcess(bundle, tmp_path / "serve.log")
    try:
        settings = {"negative_prompt": NEGATIVE, "guidance": GUIDANCE, "seed": SEED, "steps": STEPS}
        status, _, body = request(srv.port, "POST", "/v1/images/generations", {"prompt": PROMPT, **settings},
                                  timeout=300)
        assert status == 200, body
        served = base64.b64decode(body["data"][0]["b64_json"])
        status, _, refused = request(srv.port, "POST", "/v1/images/generations",
                                     {"prompt": PROMPT, "cache_threshold": 0.1})
        assert status == 400 and refused["error"]["param"] == "cache_threshold", refused
        assert "take no such option" in refused["error"]["message"]
        status, _, refused = request(srv.port, "POST", "/v1/images/generations", {"prompt": PROMPT, "steps": 5000})
        assert status == 400, refused   # checked by its row as qic run checks it
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log_path.read_text()
    png = tmp_path / "run.png"
    qic("run", bundle, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--guidance", GUIDANCE, "--seed", SEED,
        "--steps", STEPS, "--output", png)
    assert served == png.read_bytes()


def test_qic_run_draws_the_pipelines_image_with_true_cfg_and_kv_cache(bundle, pipe, tmp_path):
    # qic run in a fresh process, as a user runs it; it imports the family's host package and no model code.
    png = tmp_path / "q21.png"
    probe = f"""
import sys
from qic.cli.run import run_cli
run_cli({str(bundle)!r}, {{"prompt": {PROMPT!r}, "negative_prompt": {NEGATIVE!r}, "guidance": {GUIDANCE},
         "seed": {SEED}, "steps": {STEPS}, "output": {str(png)!r}}})
print("MODELS", " ".join(sorted(m for m in sys.modules if m.startswith("qic.models"))))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split("MODELS ")[1].split()
    assert all(m in ("qic.models", "qic.models.qwen_image_21") or m.startswith("qic.models.qwen_image_21.host")
               for m in loaded), loaded
    ours = Image.open(png)
    assert ours.mode == "RGBA" and ours.size == SIZE[::-1]
    assert _within(ours, _reference(pipe))
    # The bound can fail: the pipeline's image of another seed, or of another negative prompt, is outside it.
    assert not _within(ours, _reference(pipe, seed=SEED + 1))
    assert not _within(ours, _reference(pipe, negative="a yellow triangle"))


def test_no_cfg_and_no_kv_cache_match_the_pipeline(bundle, pipe):
    from qic.models.qwen_image_21.host import Request, generate
    from qic.runtime.bundle import Bundle
    b = Bundle(bundle)
    plain = generate(b, Request(PROMPT, seed=SEED, steps=STEPS)).image
    assert _within(plain, _reference(pipe, negative=None))
    # kv_cache=False: the prefill at every step, the pipeline's use_kv_cache=False (the same image within
    # rounding, as the prefix is modulated at t = 0: both must hold).
    full = generate(b, Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE, seed=SEED, steps=STEPS,
                               kv_cache=False)).image
    assert _within(full, _reference(pipe, use_kv_cache=False))


def test_a_stale_prefix_breaks_the_bound(bundle, pipe):
    """The decode steps attend to the prefix K/V of another prompt (what a cache kept across requests would
    give): the image leaves the bound, so the test above would see a prefix that is not the request's."""
    from qic.models.qwen_image_21 import host
    from qic.runtime.bundle import Bundle
    b = Bundle(bundle)
    prefill = b.graph("denoiser", SIZE, BUCKET, part="prefill")
    other = host._branch(b, b.graph("text_encoder", bucket=BUCKET), host._ids(b, "a white triangle"), BUCKET,
                         (SIZE[0] // 16, SIZE[1] // 16), b.manifest["denoiser"]["axes_dims_rope"])
    latents = host.initial_noise(SEED, b.latents["z_dim"], *SIZE)
    _, k, v = prefill(other.text, latents, torch.ones(1), other.index, other.block_ids, other.key_valid,
                      other.cos, other.sin)

    good = host.generate(b, host.Request(PROMPT, seed=SEED, steps=STEPS)).image
    stale = host.generate(DecodePrefix(b, lambda _k, _v: (k, v)), host.Request(PROMPT, seed=SEED, steps=STEPS)).image
    ref = _reference(pipe, negative=None)
    assert _within(good, ref) and not _within(stale, ref)


def test_the_checkpoints_sample_sigmas_are_its_schedule(bundle, cache_dir, tmp_path):
    """A checkpoint with sample_sigmas in model_index.json (Turbo's form) samples on them, as many steps as they
    are, as the pipeline does. The same architecture: the rebuild takes every graph from the compile cache."""
    from qic.models.qwen_image_21.host import Request, generate
    from qic.runtime.bundle import Bundle
    from tests.qwen_image_21_checkpoint import load_pipeline, write_checkpoint
    sigmas = [1.0, 0.8, 0.45, 0.2]
    turbo = write_checkpoint(tmp_path / "turbo", sample_sigmas=sigmas)
    out = tmp_path / "bundle"
    proc = qic("build", "--model", turbo, "--resolution", "{}x{}".format(*SIZE), "--text-buckets", BUCKET,
               "--cache-dir", cache_dir, "--output", out)
    compiled = [line for line in proc.stdout.splitlines() if "compile" in line and "@" in line]
    assert len(compiled) == 4 and not any("built" in line for line in compiled), proc.stdout
    result = generate(Bundle(out), Request(PROMPT, seed=SEED))
    assert result.request.steps == len(sigmas)
    turbo_pipe = load_pipeline(turbo)

    def reference(**kw):
        return turbo_pipe(PROMPT, height=SIZE[0], width=SIZE[1], generator=torch.Generator().manual_seed(SEED),
                          **kw).images[0]

    assert _within(result.image, reference())
    # ... and not the default linspace schedule of as many steps (what the pipeline does without sample_sigmas).
    assert not _within(result.image, reference(sigmas=[1.0, 0.75, 0.5, 0.25]))


@pytest.mark.parametrize("flags, needle", [
    (["--batch-sizes", "1,2"], "batch sizes"),
    (["--ulysses", "2"], "--ulysses 2 (exact under the block-causal mask"),
    (["--text-buckets", "0"], "exact-length text"),
    (["--step-cache", "1,0"], "step caching"),
])
def test_what_is_not_wired_yet_is_refused_in_one_line(ckpt, tmp_path, flags, needle):
    proc = qic("build", "--model", ckpt, "--resolution", "64x64", *flags, "--cache-dir", tmp_path / "cache",
               "--output", tmp_path / "out", check=False)
    one_line_refusal(proc, "Qwen-Image-2.1", needle, "not yet")
    assert not (tmp_path / "out").exists()


def test_run_options_the_host_program_does_not_take_are_refused_in_one_line(bundle, tmp_path):
    """2.1's program takes no step-caching or aspect option: a flag or a prompts-file key naming one is refused
    before anything loads, never dropped (the run would otherwise draw an image that ignored it)."""
    proc = qic("run", bundle, "--prompt", PROMPT, "--cache-threshold", "0.1", "--output", tmp_path / "x.png",
               check=False)
    one_line_refusal(proc, "--cache-threshold: this bundle's host program (qic.models.qwen_image_21.host) takes no "
                     "such option", "--negative-prompt")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": PROMPT, "aspect": "1:1"}) + "\n")
    proc = qic("run", bundle, "--prompts-file", prompts, "--output", tmp_path / "y.png", check=False)
    one_line_refusal(proc, f"{prompts}, prompt 2: key 'aspect': this bundle's host program")
    assert not list(tmp_path.glob("*.png"))


def test_a_lora_is_refused_in_one_line_before_any_work(ckpt, tmp_path):
    """No 2.1 component merges LoRAs (yet): --lora is one line naming the family, nothing written."""
    lora = tmp_path / "lora.safetensors"
    from safetensors.torch import save_file
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 96)}, str(lora))
    proc = qic("build", "--model", ckpt, "--resolution", "64x64", "--lora", lora, "--cache-dir", tmp_path / "cache",
               "--output", tmp_path / "out", check=False)
    one_line_refusal(proc, "the qwen-image-2.1 family takes no LoRAs", "drop --lora")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_hub_id_build_fetches_the_processor_folder_and_warm_and_inspect_read_it(ckpt, tmp_path):
    """`qic build --model ORG/NAME` of a 2.1 repo (served by a local STAND-IN of the Hub's HTTP API,
    tests/hub_standin.py) fetches what the family reads, processor/ (its tokenizer) included, by the family its
    model_index.json names; `qic warm` of a 2.1 matrix by hub id plans from configs and the processor alone; `qic
    inspect` describes the bundle. Export back end: what is tested is the fetch, not the compile."""
    from tests.hub_standin import HubStandIn
    hub = HubStandIn("qic-test/qwen-image-2.1-tiny")
    hub.files.update({p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()})
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_OFFLINE": "0", "HF_TOKEN": "stand-in-token"}
    try:
        out = tmp_path / "bundle"
        qic("build", "--model", hub.repo_id, "--backend", "export", "--resolution", "{}x{}".format(*SIZE),
            "--text-buckets", BUCKET, "--cache-dir", tmp_path / "cache", "--output", out, env=env)
        matrix = tmp_path / "matrix.yaml"
        matrix.write_text(f"model: [{hub.repo_id}]\nbackend: export\nresolutions: ['{SIZE[0]}x{SIZE[1]}']\n"
                          f"text_buckets: [{BUCKET}]\n")
        warm = qic("warm", matrix, "--cache-dir", tmp_path / "warm-cache", "--dry-run", env=env)
    finally:
        hub.close()
    snapshot = next((tmp_path / "hf-home").rglob("snapshots/*/model_index.json")).parent
    assert (snapshot / "processor" / "vocab.json").is_file() and not (snapshot / "tokenizer").exists()
    assert (out / "tokenizer" / "vocab.json").is_file()
    assert "4 misses" in warm.stdout, warm.stdout   # text encoder, prefill, decode, VAE decoder
    shown = qic("inspect", out, env={"COLUMNS": "300"}).stdout
    assert "family qwen-image-2.1, host program qic.models.qwen_image_21.host" in shown, shown
    assert all(g in shown for g in ("text_encoder@L64", "denoiser@64x64@L64@prefill", "denoiser@64x64@L64@decode",
                                    "vae_decoder@64x64")), shown
    # The bundle draws what the local directory's export bundle draws: the same files, fetched.
    from qic.models.qwen_image_21.host import Request, generate
    from qic.runtime.bundle import Bundle
    local = tmp_path / "local"
    qic("build", "--model", ckpt, "--backend", "export", "--resolution", "{}x{}".format(*SIZE), "--text-buckets",
        BUCKET, "--cache-dir", tmp_path / "cache", "--output", local)
    a, b = (generate(Bundle(x), Request(PROMPT, seed=SEED, steps=STEPS)).image for x in (out, local))
    assert image_diff(a, b)[0] == 0


def test_the_eager_stand_in_runs_the_21_program_as_the_bundle(bundle, ckpt):
    """qic.builder.eager.EagerModel, the reference path of the checks, holds 2.1's graphs (prefill and decode by the
    family's own graph shapes) and its host fields (its manifest_fields hook), so the family's program runs on it
    and draws the compiled bundle's image within the bound; another seed does not."""
    from qic.builder.eager import EagerModel
    from qic.models.qwen_image_21.host import Request, generate
    from qic.runtime.bundle import Bundle
    compiled, eager = Bundle(bundle), EagerModel(ckpt, [SIZE], [BUCKET])
    for part in ("prefill", "decode", "head", None):
        assert eager.has_graph("denoiser", SIZE, BUCKET, part=part) == compiled.has_graph("denoiser", SIZE, BUCKET,
                                                                                         part=part), part
    assert eager.manifest["denoiser"] == compiled.manifest["denoiser"]
    assert eager.manifest["prompt"] == compiled.manifest["prompt"]

    def draw(model, seed=SEED):
        return generate(model, Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE, seed=seed,
                                       steps=STEPS)).image
    want = draw(compiled)
    assert _within(draw(eager), want)
    assert not _within(draw(eager, SEED + 1), want)


def test_no_kv_cache_reaches_the_program_from_the_flag_and_a_prompts_file_line(bundle, tmp_path, monkeypatch):
    """`qic run --no-kv-cache`, and a prompts-file line's "kv_cache": false, reach the program as kv_cache=False
    (the pipeline's use_kv_cache=False: test_no_cfg_and_no_kv_cache_match_the_pipeline); not given, None (kept)."""
    from click.testing import CliRunner

    from qic.cli import main
    from qic.models.qwen_image_21 import host
    seen = []

    def record(model, req):
        seen.append(req.kv_cache)
        raise SystemExit(0)
    monkeypatch.setattr(host, "generate", record)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "kv_cache": False}) + "\n")
    for args in (["--prompt", PROMPT, "--no-kv-cache"], ["--prompts-file", str(prompts)], ["--prompt", PROMPT]):
        result = CliRunner().invoke(main, ["run", str(bundle), *args, "--output", str(tmp_path / "x.png")])
        assert result.exit_code == 0, result.output
    assert seen == [False, False, None]


def test_previews_follow_every_step_and_end_at_the_image(ckpt):
    """The 2.1 program's previews (qic serve's partial images), on the eager stand-in."""
    from qic.builder.eager import EagerModel
    from qic.models.qwen_image_21.host import Request, generate
    from tests.helpers import check_previews
    model = EagerModel(ckpt, [SIZE], [BUCKET])
    check_previews(lambda previews: generate(model, Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE,
                                                            seed=SEED, steps=STEPS), previews))
