"""Where features meet: strict config types, the CLI's one error path, what keys a build, and inputs that
must be refused in one line (issue 19's findings 2, 3, 8, 9, 10 and 11's test hooks)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from qic.errors import BundleError, ConfigError
from qic.spec import BuildSpec, load_spec, parse_spec
from tests.conftest import ROOT, qic

# ---- finding 2: every key parses by type ---------------------------------------------------------

_FIELDS = {f.name: f.type for f in dataclasses.fields(BuildSpec)}
# Wrong-typed values per kind of key, as YAML gives them: strings where booleans go ("false" is truthy),
# a bare number where a list goes, floats and booleans where integers go (True == 1 in Python).
_WRONG = {"bool": ['"false"', '"true"', "1", "0", "null", "[true]"],
          "list": ["5", "true", "{a: 1}"],
          "int list": ["2.5", "[72.5]", "true", "[true]", '"x"', "{a: 1}"],   # one integer is the one-item list
          "int": ['"2"', "2.5", "true", "[1]"],
          "str": ["5", "[a]", "true"]}
_LIST_KEYS = ("resolutions", "components", "cache_public_keys", "loras")
_INT_LIST_KEYS = ("text_buckets", "batch_sizes")
_INT_KEYS = ("tp", "lnc", "text_bucket_step", "ulysses")
_STR_KEYS = ("output", "cache_dir", "model", "cache_from", "cpu_target")


def _kind(key: str) -> str | None:
    if _FIELDS.get(key) == "bool":
        return "bool"
    kinds = (("list", _LIST_KEYS), ("int list", _INT_LIST_KEYS), ("int", _INT_KEYS), ("str", _STR_KEYS))
    return next((k for k, keys in kinds if key in keys), None)


def test_the_table_covers_every_boolean_key_of_the_spec():
    # Derived from the dataclass, so a new boolean key is in the table below without anyone adding it.
    assert {k for k, t in _FIELDS.items() if t == "bool"} == {"full_hash", "xla_check", "cache_trusted", "cfg_parallel"}


@pytest.mark.parametrize("key,value", [(k, v) for k in [*_FIELDS, "text_bucket_step"] if _kind(k)
                                       for v in _WRONG[_kind(k)]])
def test_a_wrongly_typed_value_is_refused_naming_key_value_file_and_line(tmp_path, key, value):
    cfg = tmp_path / "build.yaml"
    cfg.write_text(f"backend: inductor\n{key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_spec(cfg)
    assert f"{cfg}:2:" in e.value.message and key in e.value.message, e.value.message


def test_cache_trusted_string_false_does_not_trust(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text('cache_from: /somewhere\ncache_trusted: "false"\n')
    with pytest.raises(ConfigError, match=r"b.yaml:2: cache_trusted must be true or false, got 'false'"):
        load_spec(cfg)
    assert load_spec(None, {"cache_trusted": True}).cache_trusted is True   # the flag's form still works


def test_right_types_still_parse_and_flags_keep_their_comma_form():
    spec = parse_spec({"full_hash": True, "xla_check": False, "components": "denoiser,vae_decoder",
                       "text_buckets": "72,128", "batch_sizes": "1,2", "tp": 2, "lnc": 2, "output": "o"})
    assert (spec.full_hash, spec.xla_check, spec.components, spec.text_buckets, spec.batch_sizes) == \
        (True, False, ("denoiser", "vae_decoder"), (72, 128), (1, 2))


@pytest.mark.parametrize("raw,needle", [
    ({"text_buckets": [72.5]}, "text_buckets"), ({"output": None}, "output"), ({"components": 5}, "components"),
    ({"resolutions": 512}, "resolutions"), ({"scheduler": {"shift": float("nan")}}, "scheduler.shift"),
    ({"loras": [{"file": "x", "scale": float("inf")}]}, "LoRA scale"), ({"lnc": True}, "lnc"),
    ({"text_buckets": [10**30]}, "text_buckets")])
def test_values_that_were_silently_bent_are_refused(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_spec(raw)


def test_yaml_errors_keep_their_line(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text("tp: 1\nresolutions: [48x80\ncomponents: [vae_decoder]\n")
    with pytest.raises(ConfigError, match=r"b.yaml:3: not valid YAML"):
        load_spec(cfg)


# ---- finding 10: one line for every bad input, traceback only under --debug ---------------------------

def _one_line_refusal(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and all(x.startswith("  fix: ") for x in lines[1:]), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("content,needle", [
    (b"tp: 1\n\xff\xfe: 2\n", "not UTF-8"), (b"components: 5\n", "components"), (b"resolutions: 512\n", "resolutions"),
    (b"output: null\n", "output"), (b"text_buckets: [72.5]\n", "text_buckets"), (b"xla_check: 'false'\n", "xla_check"),
    (b"- a\n- b\n", "expected a mapping")])
def test_bad_build_configs_are_one_line(tmp_path, content, needle):
    cfg = tmp_path / "b.yaml"
    cfg.write_bytes(content)
    proc = qic("build", cfg, "--cache-dir", tmp_path / "c", check=False)
    _one_line_refusal(proc, str(cfg), needle)
    assert not (ROOT / "None").exists() and not (tmp_path / "c").exists()   # nothing written


def _fake_bundle(tmp_path, manifest: str):
    b = tmp_path / "b"
    b.mkdir()
    (b / "manifest.json").write_text(manifest)
    return b


def test_a_manifest_that_is_an_array_is_one_line(tmp_path):
    _one_line_refusal(qic("run", _fake_bundle(tmp_path, "[1, 2]"), "--prompt", "x", check=False), "corrupt manifest")


def _bundle_of_format(bundle, tmp_path, fmt: int):
    """The session bundle with its manifest's format set to `fmt` (its id recomputed, its files linked)."""
    from qic.manifest import MANIFEST, bundle_id
    copy = tmp_path / f"format-{fmt}"
    shutil.copytree(bundle, copy, copy_function=os.link)
    manifest = json.loads((bundle / MANIFEST).read_text()) | {"format": fmt}
    (copy / MANIFEST).unlink()
    (copy / MANIFEST).write_text(json.dumps(manifest | {"id": bundle_id(manifest)}))
    return copy


def test_a_bundle_from_the_future_says_upgrade_before_loading_anything(bundle, tmp_path, monkeypatch):
    """A bundle made by a newer qic (format FORMAT_VERSION + 1, a valid manifest otherwise) is refused with
    "upgrade qic", not "rebuild", before any graph loads; the same bundle at this FORMAT_VERSION loads."""
    from qic.manifest import FORMAT_VERSION
    from qic.runtime import bundle as runtime_bundle
    future = _bundle_of_format(bundle, tmp_path, FORMAT_VERSION + 1)
    proc = qic("run", future, "--prompt", "x", "--output", tmp_path / "x.png", check=False)
    _one_line_refusal(proc, f"bundle format {FORMAT_VERSION + 1} is newer", "upgrade qic")
    assert "rebuild" not in proc.stderr and not (tmp_path / "x.png").exists()
    loaded = []
    monkeypatch.setattr(runtime_bundle, "verify_files", lambda *a, **k: loaded.append(a) or 0)
    with pytest.raises(BundleError, match="upgrade qic"):
        runtime_bundle.Bundle(future)
    assert not loaded   # refused at the manifest: not a file was checked, let alone a graph loaded
    assert runtime_bundle.Bundle(_bundle_of_format(bundle, tmp_path, FORMAT_VERSION)).graphs   # the control


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


def _invoke(monkeypatch, exc, debug=False):
    """`qic build` whose work raises `exc`: what the CLI's one error path makes of it."""
    import qic.cli.build as build_verb
    from qic.cli import main

    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr(build_verb, "run_build", fail)
    monkeypatch.delenv("QIC_DEBUG", raising=False)
    return CliRunner().invoke(main, ["--debug", "build"] if debug else ["build"])


def test_disk_full_and_unwritable_paths_are_one_line_naming_the_file(monkeypatch):
    full = _invoke(monkeypatch, OSError(errno.ENOSPC, "No space left on device", "/data/bundle/weights.bin"))
    assert full.exit_code == 2, full.output
    assert "error: /data/bundle/weights.bin: No space left on device" in full.output
    assert "free some disk space" in full.output
    denied = _invoke(monkeypatch, PermissionError(errno.EACCES, "Permission denied", "/out"))
    assert denied.exit_code == 2 and "error: /out: Permission denied" in denied.output


def test_an_unexpected_failure_is_one_line_and_debug_shows_the_traceback(monkeypatch):
    quiet = _invoke(monkeypatch, RuntimeError("boom\nsecond line"))
    assert quiet.exit_code == 2 and quiet.output.splitlines()[0] == "error: internal error: RuntimeError: boom"
    assert "--debug" in quiet.output and "Traceback" not in quiet.output
    loud = _invoke(monkeypatch, RuntimeError("boom"), debug=True)
    assert isinstance(loud.exception, RuntimeError)   # raised through: click's runner holds the traceback
    os.environ.pop("QIC_DEBUG", None)


def test_disk_full_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
    from qic import fsutil

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(fsutil.os, "fsync", full)
    with pytest.raises(OSError):
        fsutil.write_bytes_atomic(tmp_path / "out.png", b"x" * 1000)
    assert list(tmp_path.iterdir()) == []


# ---- finding 3: the tokenizer keys the bundle -----------------------------------------------------

def test_editing_the_tokenizer_and_rebuilding_gives_the_new_tokenizer(tmp_path, tiny_ckpt, cache_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt, copy_function=os.link)   # weights hard-linked: same shard keys
    tok = ckpt / "tokenizer" / "tokenizer_config.json"
    out = tmp_path / "bundle"
    args = ("build", "--model", ckpt, "--cache-dir", cache_dir, "--output", out, "--components", "vae_decoder",
            "--resolution", "16x16")
    qic(*args)
    os.unlink(tok)   # a hard link: write a new file, not into the shared one
    edited = {**json.loads((tiny_ckpt / "tokenizer" / "tokenizer_config.json").read_text()), "model_max_length": 77}
    tok.write_text(json.dumps(edited))
    second = qic(*args)
    assert "bundle written" in second.stdout, second.stdout
    assert json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())["model_max_length"] == 77
    assert "bundle unchanged" in qic(*args).stdout   # and unchanged when nothing changed


# ---- finding 9: the code digest covers what export runs -------------------------------------------

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
    assert {"host/latents.py", "host/prompt.py", "graph_names.py", "models/mmdit.py"} <= keyed
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


# ---- finding 8: --weights uses the verification records ------------------------------------------

def test_weights_from_another_bundle_are_not_rehashed_on_every_load(bundle, bundle_two_res, monkeypatch):
    from qic import manifest as manifest_module
    from qic.runtime.bundle import Bundle
    other = bundle_two_res[0]
    Bundle(bundle, weights_from=other)   # the first load hashes (and records) the other's weights
    hashed = []
    real = manifest_module.sha256_file
    monkeypatch.setattr(manifest_module, "sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    Bundle(bundle, weights_from=other)
    assert not [p for p in hashed if str(p).startswith(str(other)) and "/weights/" in str(p)], hashed
    hashed.clear()
    Bundle(bundle, weights_from=other, verify_all=True)   # --verify-all still re-hashes them
    assert [p for p in hashed if str(p).startswith(str(other)) and "/weights/" in str(p)]


# ---- finding 11: no test hooks in production code ---------------------------------------------------

def test_qic_reads_no_test_hooks_from_the_environment():
    found = subprocess.run(["grep", "-rn", "QIC_TEST", str(ROOT / "qic")], capture_output=True, text=True).stdout
    assert found == "", found



# ---- finding 15: concurrent builds to one output ---------------------------------------------------

def test_concurrent_builds_to_one_output_take_turns(tmp_path, tiny_ckpt, cache_dir, monkeypatch):
    """Both builds are held at the up-to-date check until both are there (or 3 s pass): unserialised, both
    would find the output missing and both swap (one failing, or writing twice); serialised, the second
    finds the first's bundle up to date."""
    import threading

    from qic.builder import bundle as bundle_stage
    from qic.builder.pipeline import build
    gate = threading.Barrier(2, timeout=3)
    real = bundle_stage._up_to_date

    def meet_then_check(out, key):
        try:
            gate.wait()
        except threading.BrokenBarrierError:
            pass   # the other build is not there: it holds the lock, or has finished
        return real(out, key)
    monkeypatch.setattr(bundle_stage, "_up_to_date", meet_then_check)
    spec = load_spec(None, {"model": str(tiny_ckpt), "cache_dir": str(cache_dir), "output": str(tmp_path / "out"),
                            "components": "vae_decoder", "resolutions": ["16x16"]})
    from qic.spec import with_changes
    build(with_changes(spec, output=str(tmp_path / "first")))   # graphs memoised: the threads export nothing
    results, errors = [], []   # (torch.export is not thread-safe; the bundle stage is what is under test)

    def one():
        try:
            results.append(build(spec).up_to_date)
        except Exception as e:   # noqa: BLE001 - the test reports whatever a build raised
            errors.append(e)
    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and sorted(results) == [False, True], (results, errors)
    from qic.manifest import read_manifest, verify_files
    verify_files(tmp_path / "out", read_manifest(tmp_path / "out"), full=True)
