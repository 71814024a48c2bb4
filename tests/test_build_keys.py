"""What a build's keys see: an edited tokenizer gives a rebuilt bundle (issue 19's finding 3), and every qic
module export runs is in the spec keys' code digest (finding 9), found by an import walk that sees imports
inside functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, qic

# ---- issue 19's finding 3: the tokenizer keys the bundle -------------------------------------------------

@pytest.mark.slow
def test_editing_the_tokenizer_and_rebuilding_gives_the_new_tokenizer(tmp_path, tiny_ckpt, cache_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt, copy_function=os.link)   # weights hard-linked: same shard keys
    tok = ckpt / "tokenizer" / "tokenizer_config.json"
    out = tmp_path / "bundle"
    args = ("build", "--model", ckpt, "--cache-dir", cache_dir, "--output", out, "--components", "vae_decoder",
            "--resolution", "16x16", "--backend", "export")   # the bundle stage is under test, not a compile
    qic(*args)
    os.unlink(tok)   # a hard link: write a new file, not into the shared one
    edited = {**json.loads((tiny_ckpt / "tokenizer" / "tokenizer_config.json").read_text()), "model_max_length": 77}
    tok.write_text(json.dumps(edited))
    second = qic(*args)
    assert "bundle written" in second.stdout, second.stdout
    assert json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())["model_max_length"] == 77
    assert "bundle unchanged" in qic(*args).stdout   # and unchanged when nothing changed


# ---- issue 19's finding 9: the code digest covers what export runs ---------------------------------------

_PROFILE = r"""
import json, sys
from qic.builder.binding import bound_module
from qic.builder.context import Context
from qic.builder.jobs import plan_jobs
from qic.backends import backend_for
from qic.spec import parse_spec
from qic.weights import named_tensors

files = set()
def record(frame, event, arg):
    if event == "call" and "/qic/" in frame.f_code.co_filename:
        files.add(frame.f_code.co_filename)
spec = parse_spec({"tp": int(sys.argv[1]), "cache_dir": sys.argv[2], "output": sys.argv[2] + "/out",
                   "resolutions": ["16x16"], "text_buckets": [72]})
ctx = Context(spec, None)
backend = backend_for(spec)
seen = set()
for job in plan_jobs(spec, ctx.configs, ctx.raw, backend):
    if job.component in seen:
        continue
    seen.add(job.component)
    sys.setprofile(record)   # from binding the module to the traced graph: what shapes the graph
    gdef = job.maker(bound_module(ctx, job.component, None))
    backend.trace(gdef, named_tensors(gdef.module))
    sys.setprofile(None)
print(json.dumps(sorted(files)))
"""

# Run while binding and tracing, but not graph-shaping: stand-in weights and the stage plumbing; the spec's
# accessors (dtype_of, layers_of) hand over values the spec key holds itself; jobs.py's maker is a one-line
# closure over graphs.make_graph.
_NOT_GRAPH_CODE = {"builder/binding.py", "builder/components.py", "builder/context.py", "weights.py",
                   "checkpoint/safetensors_file.py", "spec.py", "builder/jobs.py"}


@pytest.mark.parametrize("tp", [1, 2])
def test_every_module_export_runs_is_in_the_code_digest(tmp_path, tp):
    from qic.builder.jobs import _QIC, code_files
    proc = subprocess.run([sys.executable, "-c", _PROFILE, str(tp), str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = {os.path.relpath(f, _QIC) for f in json.loads(proc.stdout.splitlines()[-1])}
    keyed = {str(f.relative_to(_QIC)) for f in code_files()}
    missing = sorted(ran - keyed - _NOT_GRAPH_CODE)
    assert not missing, f"export runs {missing}, which the spec keys' code digest leaves out"
    assert {"host/latents.py", "host/prompt.py", "graph_names.py", "models/qwen_image/mmdit.py"} <= keyed
    if tp > 1:
        assert "parallel/tp.py" in ran and "parallel/tp.py" in keyed


def test_the_import_walk_finds_a_module_only_imported_inside_a_function(tmp_path, monkeypatch):
    from qic.builder import jobs
    pkg = tmp_path / "qic"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "m.py").write_text("def f():\n    from qic.helper import g\n    return g\n")
    (pkg / "helper.py").write_text("def g(): pass\n")
    (pkg / "unused.py").write_text("")
    monkeypatch.setattr(jobs, "_QIC", pkg)
    monkeypatch.setattr(jobs, "CODE_ROOTS", ("qic.models",))
    jobs.code_files.cache_clear()
    try:
        found = {str(f.relative_to(pkg)) for f in jobs.code_files()}
    finally:
        jobs.code_files.cache_clear()
    assert found == {"__init__.py", "models/__init__.py", "models/m.py", "helper.py"}


# ---- a graph's spec key covers every config its graph maker reads ----------------------------------------

@pytest.mark.parametrize("spec_dict", [
    {"model": "embedded:tiny", "resolutions": ["48x80"], "text_buckets": [0]},
    {"model": "embedded:shapes-edit", "resolutions": ["128x128"], "condition_sizes": ["128x128"]},
    {"model": str(ROOT / "tests" / "fixtures" / "qwen-image-2.1-configs"), "resolutions": ["256x256"],
     "text_buckets": [256], "condition_sizes": ["256x256"], "condition_images": 2},
], ids=["tiny", "shapes-edit", "qwen-image-2.1-images"])
def test_each_graph_reads_only_the_configs_that_key_it(spec_dict, tmp_path):
    """Each graph of a build is made (on fake tensors, as `qic plan` estimates it) from the configs of its
    component's config_deps folders alone: a config read beyond them would not be in the graph's spec key, and a
    checkpoint differing only there would be served another checkpoint's graph (the edit denoiser's vision-token
    slots read the vision tower's patch and merge sizes, in the text encoder's folder)."""
    from qic import family
    from qic.builder.jobs import graph_shapes
    from qic.builder.memplan import estimate_graph, estimated_shape
    from qic.builder.source import resolve_configs
    from qic.spec import parse_spec
    before = family.current()
    spec = parse_spec({**spec_dict, "cache_dir": str(tmp_path)})
    family.use(spec.family)
    try:
        configs, _ = resolve_configs(spec.model, tmp_path)
        made = []
        for name, shape in graph_shapes(spec):
            deps = family.component(name).config_deps
            own = {n: c for n, c in configs.items() if family.component(n).folder in deps}
            estimate_graph(name, own, spec.tp, spec.dtype_of(name), estimated_shape(shape), spec.layout)
            made.append(name)
    finally:
        family.use(before)
    assert len(set(made)) >= 3, made
