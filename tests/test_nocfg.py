"""Issue 10's no-CFG step graph (guidance 1, as Lightning runs), on a Lightning bundle of the session bundle's
checkpoint: built only as new work, run by guidance 1 against diffusers with the overridden schedule, one
transformer call a step; and that bundle's run defaults and an aspect preset through `qic run`."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from qic.builder.eager import EagerModel
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
from tests.conftest import BUCKETS, TINY_RES, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL

BOUND_MAX, BOUND_MEAN = MAX_PIXEL, MEAN_PIXEL   # fp32 end to end: only rounding at the 0..255 quantisation differs
LIGHTNING = {"use_dynamic_shifting": True, "base_shift": 1.0986122886681098, "max_shift": 1.0986122886681098,
             "shift_terminal": None, "time_shift_type": "exponential"}
PROMPT = "a red bicycle"


def diffusers_reference(root, prompt, guidance, steps, scheduler=None, seed=0):
    """diffusers' QwenImagePipeline, with a scheduler config override merged over the checkpoint's."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    h, w = TINY_RES
    images = []
    for sched in (scheduler, None):  # the override, then the checkpoint's own config (a reference that differs)
        if sched:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config({**pipe.scheduler.config, **sched})
        else:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(root), subfolder="scheduler")
        images.append(pipe(prompt, negative_prompt=" ", true_cfg_scale=guidance, num_inference_steps=steps,
                           height=h, width=w, generator=torch.Generator("cpu").manual_seed(seed)).images[0])
    return images


def build_rows(stdout: str) -> dict:
    """The build table's rows: item -> cached/built."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) >= 4 and cells[3] in ("cached", "built"):
            rows[f"{cells[1]} {cells[2]}"] = cells[3]
    return rows


@pytest.fixture(scope="module")
def lightning_bundle(bundle, workdir, cache_dir, tiny_ckpt):
    """The session bundle's checkpoint with the Lightning scheduler, no-CFG run defaults (so the no-CFG graph
    too), one bucket: only the no-CFG step graph is new."""
    config = workdir / "lightning-tiny.yaml"
    config.write_text(json.dumps({
        "model": str(tiny_ckpt), "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": BUCKETS[0],
        "scheduler": LIGHTNING, "defaults": {"steps": 3, "guidance": 1.0},
        "cache_dir": str(cache_dir), "output": str(workdir / "bundle-lightning")}))
    proc = qic("build", config)
    return workdir / "bundle-lightning", build_rows(proc.stdout)


def test_nocfg_graph_is_built_only_as_new_work(lightning_bundle):
    out, rows = lightning_bundle
    h, w = TINY_RES
    nocfg = f"compile denoiser@{h}x{w}@L{BUCKETS[0]}@nocfg"
    assert nocfg in rows and all(v == "cached" for k, v in rows.items() if k.startswith(("compile", "shard"))
                                 and k != nocfg), rows   # the session bundle's graphs and shards serve the rest
    m = json.loads((out / "manifest.json").read_text())
    assert m["cfg"] == [True, False] and m["defaults"] == {"steps": 3, "guidance": 1.0}
    assert m["scheduler_overrides"] == LIGHTNING and m["scheduler"]["base_shift"] == LIGHTNING["base_shift"]
    graphs = {g["name"]: g for g in m["graphs"]}
    nocfg = graphs[f"denoiser@{h}x{w}@L{BUCKETS[0]}@nocfg"]
    assert [i["shape"][0] for i in nocfg["inputs"] if i["name"] == "text_embeds"] == [1]
    assert "guidance" not in [i["name"] for i in nocfg["inputs"]]


def _count_calls(bundle: Bundle) -> dict:
    calls = {}
    for g in bundle.graphs.values():
        def counted(tensors, run=g.run, name=g.name):
            calls[name] = calls.get(name, 0) + 1
            return run(tensors)
        g.run = counted
    return calls


def test_guidance_1_runs_the_nocfg_graph_and_matches_diffusers(lightning_bundle, tiny_ckpt):
    out, _ = lightning_bundle
    b = Bundle(out)
    calls = _count_calls(b)
    h, w = TINY_RES
    result = generate(b, Request(PROMPT))              # the bundle's defaults: 3 steps, guidance 1
    assert (result.request.steps, result.request.guidance) == (3, 1.0)
    assert calls == {f"text_encoder@L{BUCKETS[0]}": 1, f"denoiser@{h}x{w}@L{BUCKETS[0]}@nocfg": 3,
                     f"vae_decoder@{h}x{w}": 1}, calls
    ref, default_sched = diffusers_reference(tiny_ckpt, PROMPT, 1.0, 3, scheduler=LIGHTNING)
    mx, mean = image_diff(result.image, ref)
    print(f"no-CFG graph, Lightning schedule vs diffusers (true_cfg_scale 1): max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    # The bound can fail: the checkpoint's own scheduler config gives another image.
    assert image_diff(result.image, default_sched)[0] > BOUND_MAX
    # Guidance above 1 with a negative prompt takes the CFG graph (both prompts encoded).
    calls.clear()
    generate(b, Request(PROMPT, guidance=4.0, steps=2))
    assert calls == {f"text_encoder@L{BUCKETS[0]}": 2, f"denoiser@{h}x{w}@L{BUCKETS[0]}": 2,
                     f"vae_decoder@{h}x{w}": 1}, calls


def test_nocfg_step_calls_the_transformer_once_per_step_with_batch_1(tiny_ckpt):
    """The eager no-CFG step: counted at the transformer itself (compiled graphs cannot be hooked)."""
    model = EagerModel(tiny_ckpt, [TINY_RES], [0])
    batches = []
    model.modules["denoiser"].register_forward_hook(lambda mod, args, out: batches.append(args[0].shape[0]))
    generate(model, Request(PROMPT, guidance=1.0, steps=3))
    assert batches == [1, 1, 1]
    batches.clear()
    generate(model, Request(PROMPT, guidance=4.0, steps=3))
    assert batches == [2, 2, 2]


def test_run_aspect_and_defaults_through_the_cli(lightning_bundle, tmp_path):
    out, _ = lightning_bundle
    png = tmp_path / "a.png"
    qic("run", out, "--prompt", PROMPT, "--aspect", "5:3", "--output", png)
    info = Image.open(png).text
    assert info["resolution"] == "{}x{}".format(*TINY_RES) and info["steps"] == "3" and info["guidance"] == "1.0"
