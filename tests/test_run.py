"""Issue 4: `qic run` — parity with diffusers, resident modes, reproducibility, refusals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

from qic.manifest import bundle_id
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
from tests.conftest import BUCKETS, ROOT, SECOND_RES, TINY_RES, diffusers_image, image_diff, qic
from tests.helpers import one_line_refusal as _one_line_refusal

# Max-abs in 0..255 pixel units. The fp32 pipelines agree to ~1e-5 relative (summation order), far
# below one level (1/255 of the [-1, 1] range / 2 = 2e-3), so a pixel differs only where a value sits
# within that of a rounding boundary: by one level, two where guidance amplifies it. Such pixels are
# rare, hence mean < 0.05. A wrong prompt, seed or guidance moves pixels by tens of levels.
BOUND = 2.0
SHORT = "a red bicycle"
LONG = ("a red bicycle leaning against a weathered blue wall under a striped awning, with potted plants, "
        "a sleeping cat and warm evening light on the cobblestones")
STEPS = 5


def test_runtime_imports_no_model_or_compiler_code(bundle, tmp_path):
    # (torch.export is absent from the list: `import torch` itself imports it.)
    code = f"""
import sys
from qic.cli.run import run_cli
run_cli({str(bundle)!r}, {{"prompt": "a cat", "steps": 2, "output": {str(tmp_path / 'x.png')!r}}})
# A family folder's host program (qic/models/<family>/host.py, or a host/ package of host-only modules, with the
# two packages it sits in) is the one part of qic.models a runtime may import (qic.runtime.programs); this
# bundle's, text-to-image, is qic.runtime's.
from qic.family import packages
hosts = {{"qic.models"}} | {{m for p in packages() if p.startswith("qic.models.") for m in (p, p + ".host")}}
host_parts = tuple(p + ".host." for p in packages())   # a host program that is a package: its own modules
bad = sorted(m for m in sys.modules if m.startswith(("qic.models", "qic.builder", "qic.backends.inductor.build",
             "qic.backends.neuron.build", "torch._inductor", "torch._dynamo", "diffusers", "transformers"))
             and m != "qic.backends.inductor.load" and m not in hosts and not m.startswith(host_parts))
print("BAD", bad)
print("QIC", " ".join(m for m in sys.modules if m.startswith("qic.")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "BAD []" in out, out
    # docs/design.md's list of what the runtime imports is true both ways.
    loaded = set(out.split("QIC ")[1].split())
    doc = (ROOT / "docs" / "design.md").read_text()
    bullet = doc.split("- `qic.runtime` (run time) imports")[1].split("Never")[0]
    listed = set(re.findall(r"`(qic\.[\w.]+)`", bullet))
    covered = {m for m in loaded if any(m == d or m.startswith(d + ".") or d.startswith(m + ".") for d in listed)
               or m.startswith(("qic.runtime", "qic.cli"))         # itself and its verb
               or m.startswith("qic.backends.inductor")}            # the chosen back end's run half (BAD: not build)
    assert covered == loaded, f"imported but not in docs/design.md: {sorted(loaded - covered)}"
    assert all(any(m == d or m.startswith(d + ".") for m in loaded) for d in listed), \
        f"in docs/design.md but not imported: {sorted(d for d in listed if d not in loaded)}"


@pytest.mark.parametrize("res", [TINY_RES, SECOND_RES], ids=lambda r: "{}x{}".format(*r))
def test_run_matches_diffusers_at_every_resolution_and_bucket(bundle_two_res, tiny_ckpt, res):
    b = Bundle(bundle_two_res[0])
    h, w = res
    for prompt, bucket in ((SHORT, BUCKETS[0]), (LONG, BUCKETS[1])):
        result = generate(b, Request(prompt, steps=STEPS, seed=3, height=h, width=w))
        assert result.bucket == bucket
        ref = diffusers_image(tiny_ckpt, prompt, " ", 4.0, seed=3, steps=STEPS, height=h, width=w)
        mx, mean = image_diff(result.image, ref)
        print(f"{h}x{w} bucket {bucket}: qic run vs diffusers max {mx:.0f}/255 mean {mean:.4f}")
        assert mx <= BOUND and mean < 0.05
    # The bound can fail: another guidance or another prompt word breaks it.
    for wrong in ({"guidance": 3.0}, {"prompt": SHORT.replace("red", "green")}):
        kw = {"prompt": SHORT, "guidance": 4.0, **wrong}
        other = diffusers_image(tiny_ckpt, kw["prompt"], " ", kw["guidance"], seed=3, steps=STEPS, height=h, width=w)
        ours = generate(b, Request(SHORT, steps=STEPS, seed=3, height=h, width=w)).image
        assert image_diff(ours, other)[0] > BOUND, wrong


def test_a_process_that_ends_without_cleaning_up_leaves_no_extracted_graphs(bundle, tmp_path):
    """torch extracts each AOTInductor package into a directory under the temp dir and removes it only when its
    loader is destroyed; a server stopped by a signal or a killed rank never destroys it (~4 MB a graph, every
    start). qic removes the directory once the library is loaded: a run ended by os._exit leaves none, and the
    graphs ran after their files were gone."""
    temp = tmp_path / "temp"
    temp.mkdir()
    code = f"""
import os
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate
bundle = Bundle({str(bundle)!r})     # alive until the end, as a server's is
print("PIXELS", generate(bundle, Request("a cat", steps=2)).image.size)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "TMPDIR": str(temp)}).stdout
    assert "PIXELS" in out, out
    assert not [p.name for p in temp.iterdir() if p.name.startswith("aotinductor_")]


def test_cli_run_matches_diffusers_and_png_is_reproducible(bundle, tiny_ckpt, tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"img{i}.png"
        proc = qic("run", bundle, "--prompt", SHORT, "--negative-prompt", "blurry", "--steps", STEPS,
                   "--guidance", "3.5", "--seed", "11", "--output", out)
        assert f"wrote {out}" in proc.stdout
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    im = Image.open(outs[0])
    assert im.text["prompt"] == SHORT and im.text["negative_prompt"] == "blurry" and im.text["seed"] == "11"
    assert im.text["steps"] == str(STEPS) and im.text["guidance"] == "3.5"
    assert im.text["bundle"] == json.loads((bundle / "manifest.json").read_text())["id"]
    ref = diffusers_image(tiny_ckpt, SHORT, "blurry", 3.5, seed=11, steps=STEPS)
    assert image_diff(im.convert("RGB"), ref)[0] <= BOUND


def test_bucketed_and_exact_length_builds_agree(bundle, bundle_exact, tiny_ckpt):
    """The exact-length bundle's step takes the prompt's and the negative prompt's text at their own lengths (packed
    CFG: tests/test_packed_cfg.py), which differ here (a prompt and " ")."""
    a, b = Bundle(bundle), Bundle(bundle_exact)
    step = b.graph("denoiser", TINY_RES, 0)
    assert [i["name"] for i in step.inputs][1:3] == ["text_embeds", "negative_embeds"]
    for prompt in (SHORT, LONG):
        ia = generate(a, Request(prompt, steps=STEPS, seed=5)).image
        rb = generate(b, Request(prompt, steps=STEPS, seed=5))
        assert rb.bucket == 0
        mx, mean = image_diff(ia, rb.image)
        print(f"bucketed vs exact: max {mx:.0f} mean {mean:.4f}")
        assert mx <= BOUND
        ref = diffusers_image(tiny_ckpt, prompt, " ", 4.0, seed=5, steps=STEPS)
        assert image_diff(rb.image, ref)[0] <= BOUND


def test_cfg_off(bundle, tiny_ckpt):
    b = Bundle(bundle)
    for guidance, neg in ((1.0, " "), (4.0, None)):
        ours = generate(b, Request(SHORT, negative_prompt=neg, guidance=guidance, steps=STEPS)).image
        ref = diffusers_image(tiny_ckpt, SHORT, neg, guidance, seed=0, steps=STEPS)
        assert image_diff(ours, ref)[0] <= BOUND


def test_resident_prompts_file_pays_the_load_once(bundle, tmp_path):
    lines = []
    for i in range(20):
        if i % 2:
            lines.append(json.dumps({"prompt": f"a cat number {i}", "seed": i, "steps": 2}))
        else:
            lines.append(f"a dog number {i}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    proc = qic("run", bundle, "--prompts-file", prompts, "--steps", "2", "--output", tmp_path / "out.png",
               "--verbose")
    pngs = sorted(tmp_path.glob("out-*.png"))
    assert len(pngs) == 20
    timings = [line for line in proc.stdout.splitlines() if line.startswith("timing:")]
    assert len(timings) == 20
    # Each prompt reports the load time measured since the previous one (Bundle.seconds_loading), so a
    # bundle reloaded per prompt would show its load (milliseconds at least: it re-reads and re-hashes
    # the manifest and compiled graphs) on every line.
    loads = [float(t.split("load ")[1].split("s")[0]) for t in timings]
    assert loads[0] > 0 and all(x == 0.0 for x in loads[1:]), loads
    assert Image.open(pngs[1]).text["seed"] == "1"
    for key in ("tokenize", "encode", "step0", "step1", "decode", "save"):
        assert key in timings[0]


def test_aspect_picks_the_bundle_resolution_of_that_ratio(bundle_two_res, tmp_path):
    """A bundle of two aspect ratios (48x80 is W:H 5:3, 32x48 is 3:2; HxW): --aspect on the command line
    and "aspect" on a prompts-file line each choose the image size. The flag asks for the bundle's second
    resolution, so a dropped flag (the first, the default) fails; the line asks for the other one than the
    flag, so a dropped line option (the flag's) fails."""
    out, _ = bundle_two_res
    assert Bundle(out).resolutions[0] == TINY_RES != SECOND_RES
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{SHORT}\n" + json.dumps({"prompt": SHORT, "aspect": "5:3"}) + "\n")
    qic("run", out, "--prompts-file", prompts, "--aspect", "3:2", "--steps", "2", "--output", tmp_path / "a.png")
    for png, (h, w) in ((tmp_path / "a-000.png", SECOND_RES), (tmp_path / "a-001.png", TINY_RES)):
        image = Image.open(png)
        assert image.size == (w, h) and image.text["resolution"] == f"{h}x{w}", png


def test_interactive_mode(bundle, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qic.cli", "run", str(bundle), "--interactive", "--steps", "2",
                           "--output", str(tmp_path / "i.png")], input="a cat\na dog\n\n", capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert len(list(tmp_path.glob("i-*.png"))) == 2


# ------------------------------------------------------------------------------------------- refusals

def _run_fails(*args, expect: str):
    proc = qic("run", *args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert expect in lines[0], lines[0]
    return lines[0]


def _copy_bundle(bundle, tmp_path):
    import shutil
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def test_unknown_bundle_path(tmp_path):
    _run_fails(tmp_path / "nope", "--prompt", "x", expect="no such bundle")


@pytest.mark.parametrize("target", ["graph", "weights"])
def test_tampered_file_is_refused_before_any_code_loads(bundle, tmp_path, target, monkeypatch):
    b = _copy_bundle(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    g = next(g for g in m["graphs"] if g["component"] == "denoiser")
    path = b / (g["file"] if target == "graph" else g["weights"][0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    _run_fails(b, "--prompt", "x", expect="does not match its sha256")
    import qic.backends.inductor.load as loader

    def never(*a, **k):
        raise AssertionError("compiled code was loaded from a tampered bundle")
    monkeypatch.setattr(loader, "load", never)
    from qic.errors import BundleError
    with pytest.raises(BundleError, match="sha256"):
        Bundle(b)


def test_incompatible_versions_are_refused(bundle, tmp_path):
    b = _copy_bundle(bundle, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["versions"]["torch"] = "1.13.0"
    m["id"] = bundle_id(m)
    (b / "manifest.json").write_text(json.dumps(m))
    _run_fails(b, "--prompt", "x", expect="built with torch 1.13.0")
    m["versions"] = {**m["versions"], "torch": json.loads((bundle / "manifest.json").read_text())["versions"]["torch"],
                     "qic": "9.0.0"}
    m["id"] = bundle_id(m)
    (b / "manifest.json").write_text(json.dumps(m))
    _run_fails(b, "--prompt", "x", expect="built with qic 9.0.0")
    m["graphs"][0]["name"] = "edited"
    (b / "manifest.json").write_text(json.dumps(m))
    _run_fails(b, "--prompt", "x", expect="manifest content hash mismatch")


def test_resolution_not_in_bundle(bundle):
    line = _run_fails(bundle, "--prompt", "x", "--height", "64", "--width", "64", expect="not in this bundle")
    assert "{}x{}".format(*TINY_RES) in line


def test_prompt_longer_than_largest_bucket(bundle):
    _run_fails(bundle, "--prompt", " ".join(["word"] * 200), expect="longer than the largest text bucket")


@pytest.mark.parametrize("args,expect", [(("--steps", "0"), "steps"), (("--steps", "1"), "steps must be >= 2"),
                                         (("--guidance", "nan"), "guidance"), (("--guidance", "-1"), "guidance")])
def test_invalid_steps_or_guidance(bundle, args, expect):
    _run_fails(bundle, "--prompt", "x", *args, expect=expect)


_SEED, _STEPS = "seed must be an integer in [0, 2**63), got", "steps must be an integer in [1, 1001), got"


@pytest.mark.parametrize("line,needle", [('{"prompt": "a", "seed": "3"}', f"{_SEED} '3'"),
                                         ('{"prompt": "a", "seed": 3.5}', f"{_SEED} 3.5"),
                                         ('{"prompt": "a", "steps": true}', f"{_STEPS} True"),
                                         ('{"prompt": 5}', "prompt must be a non-empty string, got 5"),
                                         ('{"prompt": [1]}', "prompt must be a non-empty string, got [1]"),
                                         ('{"prompt": "a", "guidance": "4"}', "guidance must be a finite number >= 0, "
                                                                              "got '4'")])
def test_bad_prompts_file_lines_are_one_line_naming_file_and_line(bundle, tmp_path, line, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(f"a cat\n{line}\n")
    proc = qic("run", bundle, "--prompts-file", prompts, check=False)
    _one_line_refusal(proc, f"{prompts}:2:", needle)


def test_a_prompts_file_that_is_not_utf8_is_one_line(bundle, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"a cat\n\xff\xfe dog\n")
    _one_line_refusal(qic("run", bundle, "--prompts-file", prompts, check=False), "not UTF-8")


def test_interactive_under_torchrun_is_refused(bundle):
    proc = qic("run", bundle, "--interactive", check=False,
               env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    _one_line_refusal(proc, "--interactive", "torchrun")


def test_a_negative_seed_is_refused_by_run_as_by_serve(bundle, tmp_path):
    proc = qic("run", bundle, "--prompt", "x", "--seed", "-1", "--output", tmp_path / "x.png", check=False)
    _one_line_refusal(proc, "seed must be an integer in [0, 2**63)")
    assert not (tmp_path / "x.png").exists()


def test_an_option_of_another_familys_program_is_refused_in_one_line(bundle, tmp_path):
    """--no-kv-cache is Qwen-Image-2.1's (an opt-in row of qic.host.options): the text-to-image program's Request
    lacks it, so qic run refuses it on this bundle, naming the flag, instead of dropping it."""
    from tests.helpers import one_line_refusal
    proc = qic("run", bundle, "--prompt", "x", "--no-kv-cache", "--output", tmp_path / "x.png", check=False)
    one_line_refusal(proc, "--kv-cache: this bundle's host program (qic.runtime.generate) takes no such option")
    assert not (tmp_path / "x.png").exists()
