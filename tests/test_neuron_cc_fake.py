"""The neuronx-cc driver against a FAKE neuronx-cc (tests/fakes/neuronx-cc): commands, flags, file layout,
parallel compiles, caching and failures. No Neuron SDK is involved; the fake only records and writes a
deterministic fake NEFF."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from qic.backends.neuron import cc as neuron_cc
from qic.backends.neuron.cc import CompileJob, compile_many, compile_neff, component_flags
from qic.errors import CompileError, ConfigError

FAKES = Path(__file__).resolve().parent / "fakes"


@pytest.fixture
def fake_cc(tmp_path, monkeypatch):
    """The fake compiler first on PATH; returns a reader of its call log."""
    exe = FAKES / "neuronx-cc"
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "neuronxcc-calls.jsonl"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("QIC_FAKE_NEURONXCC_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def graph(root: Path, name: str, body: bytes) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "model.hlo_module.pb").write_bytes(body)
    return d


def test_fake_compiler_found_and_versioned(fake_cc):
    path, why = neuron_cc.find()
    assert path == str(FAKES / "neuronx-cc") and why == ""
    assert neuron_cc.version() == "2.99.0.0+fake"


def test_missing_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    path, why = neuron_cc.find()
    assert path is None and "neuronx-cc is not on PATH" in why and "\n" not in why
    with pytest.raises(ConfigError, match="not on PATH"):
        compile_neff(graph(tmp_path, "g", b"hlo") / "model.hlo_module.pb", tmp_path / "g", [])


def test_flags_per_component_and_config_overrides():
    assert component_flags("denoiser") == ["--target", "trn2", "--model-type", "transformer", "-O1",
                                           "--auto-cast", "none", "--lnc", "1"]
    assert "unet-inference" in component_flags("vae_decoder", lnc=2)
    merged = component_flags("text_encoder", "--auto-cast=matmult -O2 --enable-saturate-infinity", lnc=2)
    assert merged == ["--target", "trn2", "--model-type", "transformer", "-O2", "--auto-cast", "matmult",
                      "--lnc", "2", "--enable-saturate-infinity"]
    # The same options spelled differently give the same cache key; a different value does not.
    same = neuron_cc.cache_key("h", "v", ["--logical-nc-config=2", "--optlevel", "1"])
    assert same == neuron_cc.cache_key("h", "v", ["-lnc", "2", "-O1"])
    assert same != neuron_cc.cache_key("h", "v", ["--lnc", "1", "-O1"])
    assert same != neuron_cc.cache_key("h", "v2", ["--lnc", "2", "-O1"])
    with pytest.raises(ConfigError, match="--output"):
        component_flags("denoiser", "--output elsewhere.neff")
    with pytest.raises(ConfigError, match="'trn9'"):
        component_flags("denoiser", "--target trn9")


def test_compile_command_layout_and_cache(fake_cc, tmp_path):
    d = graph(tmp_path, "denoiser", b"hlo-bytes")
    flags = component_flags("denoiser")
    neff = compile_neff(d / "model.hlo_module.pb", d, flags)
    assert neff == d / "model.neff" and neff.read_bytes().startswith(b"QIC-FAKE-NEFF")
    calls = [c for c in fake_cc() if c["argv"][0] == "compile"]
    assert len(calls) == 1
    assert calls[0]["argv"] == ["compile", str(d / "model.hlo_module.pb"), "--framework", "XLA", *flags,
                                "--output", "model.neff", "--logfile", "log-neuron-cc.txt"]
    assert Path(calls[0]["cwd"]).parent == d and Path(calls[0]["cwd"]).name.startswith(".tmp-neff-")
    record = json.loads((d / "neff.json").read_text())
    assert record["compiler"] == "2.99.0.0+fake" and record["flags"] == flags
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == [
        "compiler-output.txt", "log-neuron-cc.txt", "model.hlo_module.pb", "model.neff", "neff.json"]
    # Second run: the recorded key matches, nothing is compiled.
    compile_neff(d / "model.hlo_module.pb", d, flags)
    assert len([c for c in fake_cc() if c["argv"][0] == "compile"]) == 1
    # New flags or a new compiler version change the key: compiled again.
    compile_neff(d / "model.hlo_module.pb", d, component_flags("denoiser", "--auto-cast matmult"))
    os.environ["QIC_FAKE_NEURONXCC_VERSION"] = "2.99.0.1+fake"
    try:
        compile_neff(d / "model.hlo_module.pb", d, component_flags("denoiser", "--auto-cast matmult"))
    finally:
        del os.environ["QIC_FAKE_NEURONXCC_VERSION"]
    assert len([c for c in fake_cc() if c["argv"][0] == "compile"]) == 3


def test_fake_refuses_what_the_real_parser_refuses(fake_cc, tmp_path):
    d = graph(tmp_path, "g", b"hlo")
    with pytest.raises(CompileError, match="invalid choice: 'trn9'") as e:
        compile_neff(d / "model.hlo_module.pb", d, ["--target", "trn9"])
    assert "exit status 2" in e.value.message and not (d / "model.neff").exists()
    with pytest.raises(CompileError, match="--target"):
        compile_neff(d / "model.hlo_module.pb", d, [])           # --target is required


def test_parallel_compiles_then_all_cached(fake_cc, tmp_path, monkeypatch):
    gates = tmp_path / "running"
    gates.mkdir()
    monkeypatch.setenv("QIC_FAKE_NEURONXCC_BARRIER", f"{gates}:3")   # each waits until 3 run at once
    jobs = [CompileJob(d / "model.hlo_module.pb", d, tuple(component_flags(c)))
            for c, d in [(c, graph(tmp_path, c, c.encode())) for c in ("text_encoder", "denoiser", "vae_decoder")]]
    neffs = compile_many(jobs, max_workers=3)
    assert neffs == [j.out_dir / "model.neff" for j in jobs]
    assert len({n.read_bytes() for n in neffs}) == 3
    assert len([c for c in fake_cc() if c["argv"][0] == "compile"]) == 3
    compile_many(jobs, max_workers=3)                                  # all cached: no compiler run
    assert len([c for c in fake_cc() if c["argv"][0] == "compile"]) == 3


def test_failed_compile_reported_after_the_others_finish(fake_cc, tmp_path):
    good = graph(tmp_path, "good", b"fine")
    bad = graph(tmp_path, "bad", b"FAIL please")
    jobs = [CompileJob(d / "model.hlo_module.pb", d, tuple(component_flags("denoiser"))) for d in (bad, good)]
    with pytest.raises(CompileError) as e:
        compile_many(jobs, max_workers=2)
    msg = e.value.message
    assert msg.startswith("1 of 2 NEFF compiles failed") and str(bad / "model.hlo_module.pb") in msg
    assert "the HLO asked this fake compiler to fail" in msg                   # the log's tail
    assert (good / "model.neff").is_file() and not (bad / "model.neff").exists()
    assert "ERROR: [fake]" in (bad / "compile-failed.log").read_text()
    assert not [p for p in bad.iterdir() if p.name.startswith(".tmp-")]     # no half-written work dir
    # Fixed and rebuilt: only the failed graph compiles, and its stale failure log goes.
    (bad / "model.hlo_module.pb").write_bytes(b"fixed")
    compile_many(jobs, max_workers=2)
    assert len([c for c in fake_cc() if c["argv"][0] == "compile"]) == 3
    assert (bad / "model.neff").is_file() and not (bad / "compile-failed.log").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # killed but not yet reaped by whoever adopted it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_compile_past_its_timeout_is_killed_with_its_workers(fake_cc, tmp_path, monkeypatch):
    """A hung compiler (the fake sleeping 120 s, with a worker process of its own) under a 1 s timeout: one
    CompileError line naming the graph and the timeout, the compiler's whole process group gone, no NEFF."""
    d = graph(tmp_path, "denoiser", b"hangs")
    pidfile = tmp_path / "worker.pid"
    monkeypatch.setenv("QIC_FAKE_NEURONXCC_SLEEP", f"120:{pidfile}")
    monkeypatch.setenv(neuron_cc.TIMEOUT_ENV, "1")
    t = time.monotonic()
    with pytest.raises(CompileError) as e:
        compile_many([CompileJob(d / "model.hlo_module.pb", d, tuple(component_flags("denoiser")))])
    assert time.monotonic() - t < 30   # the 1 s timeout, not the 120 s sleep
    header, *rest = e.value.message.splitlines()   # compile_many's header, then one line per failed job
    assert header.startswith("1 of 1 NEFF compiles failed") and len(rest) == 1, e.value.message
    assert str(d / "model.hlo_module.pb") in rest[0] and "ran past its 1 s timeout and was killed" in rest[0]
    worker = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the compiler's worker process outlived the timeout"
    assert not (d / "model.neff").exists() and not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    assert "worker" in (d / "compile-failed.log").read_text()   # what it printed before the kill is kept
    # The default is generous, and a bad value is refused naming the variable.
    monkeypatch.delenv(neuron_cc.TIMEOUT_ENV)
    assert neuron_cc.compile_timeout() == neuron_cc.DEFAULT_TIMEOUT >= 3600
    for bad in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv(neuron_cc.TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=neuron_cc.TIMEOUT_ENV):
            neuron_cc.compile_timeout()


def test_the_lower_only_warning_names_multi_rank_bf16_graphs_as_not_checked():
    """XLA:CPU has no bf16 collectives, so a multi-rank bf16 graph is lowered, not executed, at build (check_skipped
    says why, compile() records it), and the warning a lower-only build prints names it as not checked, beside what
    was (artifacts as compile() records them)."""
    from types import SimpleNamespace

    import torch

    from qic.backends.neuron.build import check_skipped, checked_summary
    bf16, fp32 = {"w": torch.zeros(2, dtype=torch.bfloat16)}, {"w": torch.zeros(2)}
    why = check_skipped(True, 2, bf16)
    assert why == "not run: 2-rank bfloat16 graph (XLA:CPU has no bfloat16 collectives)"
    assert check_skipped(True, 1, bf16) is None and check_skipped(True, 2, fp32) is None   # these are executed
    assert check_skipped(False, 1, fp32) == "not run (xla_check: false)"
    checked = SimpleNamespace(meta={"graph": "vae_decoder@48x80", "checks": {"xla_cpu_rel_l2": 3e-7, "tp": 1}})
    skipped = SimpleNamespace(meta={"graph": "denoiser@48x80@L128",
                                    "checks": {"xla_cpu_rel_l2": None, "tp": 2, "xla_cpu_check": why}})
    assert checked_summary([checked, skipped]) == (
        "1 of 2 graphs executed on XLA:CPU and matched eager PyTorch (1 on one XLA:CPU device); not checked: "
        f"denoiser@48x80@L128 ({why})")
    assert "not checked" not in checked_summary([checked])
