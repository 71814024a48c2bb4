"""CPU targets (qic/backends/inductor/target.py): artifacts compiled for a declared x86-64 level, recorded and
checked as that level's flags, not the build host's.

Hosts other than this one are simulated: this CPU's flags (and machine name) are replaced by a stand-in's, so
every test but the real compile passes on AVX2-only and AVX-512 machines alike. The real compile (one small
graph for x86-64-v3, about 20-40 s on two cores) needs an x86-64 machine that runs x86-64-v3.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.cpu_target import zmm_instructions
from qic.backends.inductor import target as qic_target
from qic.errors import BundleError, ConfigError

SSE4 = frozenset("cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 aes pclmulqdq".split())
SANDY_BRIDGE = SSE4 | {"avx", "xsave"}                                              # AVX, no AVX2
HASWELL = SANDY_BRIDGE | {"avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}   # x86-64-v3 exactly (+ aes)
SKYLAKE_X = HASWELL | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "adx"}
SAPPHIRE_RAPIDS = SKYLAKE_X | {"avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"}


@pytest.fixture
def host(monkeypatch):
    """host(flags): this process sees an x86-64 CPU with these /proc/cpuinfo flags."""
    def set_host(flags, machine="x86_64"):
        monkeypatch.setattr(qic_target, "host_isa", lambda: tuple(sorted(flags)))
        monkeypatch.setattr(qic_target.platform, "machine", lambda: machine)
    return set_host


def _manifest(target: dict) -> dict:
    return {"graphs": [{"name": "denoiser@48x80@L128", "target": target}], "backend": {"target": target}}


def test_a_v3_artifact_built_on_avx512_runs_on_avx2_only_and_is_refused_without_avx2(host, tmp_path):
    from qic.backends.inductor.load import check
    host(SAPPHIRE_RAPIDS)
    target = qic_target.host_target("cpu", "x86-64-v3")
    assert target["cpu_target"] == target["march"] == "x86-64-v3"
    assert not any(f.startswith(("avx512", "amx")) for f in target["isa"])   # the level's flags, not the host's
    host(HASWELL)
    assert qic_target.target_mismatch(target, "cpu") is None
    check(tmp_path, _manifest(target), "cpu")
    host(SANDY_BRIDGE)
    with pytest.raises(BundleError) as e:
        check(tmp_path, _manifest(target), "cpu")
    msg = e.value.message
    assert "\n" not in msg and "x86-64-v3" in msg and "lacks" in msg
    assert {"avx2", "fma", "bmi2"} <= set(msg.split("needs ")[1].split(";")[0].split(", ")), msg
    assert "(it has avx)" in msg


def test_a_v4_artifact_needs_avx512_but_not_the_build_hosts_extensions(host):
    host(SAPPHIRE_RAPIDS)
    target = qic_target.host_target("cpu", "x86-64-v4")
    assert "avx512f" in target["isa"] and "avx512_bf16" not in target["isa"] and "amx_tile" not in target["isa"]
    host(SKYLAKE_X)
    assert qic_target.target_mismatch(target, "cpu") is None
    host(HASWELL)
    reason = qic_target.target_mismatch(target, "cpu")
    assert reason.startswith("it was compiled for x86-64-v4, which needs avx512bw, avx512cd, avx512dq, avx512f, "
                             "avx512vl; this machine's CPU lacks them"), reason


def test_a_native_artifact_keeps_needing_every_flag_of_the_build_host(host):
    host(SAPPHIRE_RAPIDS)
    target = qic_target.host_target("cpu", "native")
    assert target["cpu_target"] == target["march"] == "native" and "avx512_bf16" in target["isa"]
    host(SKYLAKE_X)
    reason = qic_target.target_mismatch(target, "cpu")
    assert reason.startswith("it was compiled for a CPU with amx_bf16, amx_tile, avx512_bf16"), reason
    host(SAPPHIRE_RAPIDS)
    assert qic_target.target_mismatch(target, "cpu") is None


def test_auto_portable_and_explicit_targets_resolve_per_host(host, monkeypatch):
    resolve = qic_target.resolve_cpu_target
    host(SAPPHIRE_RAPIDS)
    assert (resolve("auto"), resolve("portable"), resolve("native")) == ("x86-64-v4", "x86-64-v3", "native")
    assert resolve() == resolve(qic_target.DEFAULT_CPU_TARGET)
    assert resolve(None) == "x86-64-v3"   # no cpu_target in the config: portable
    host(HASWELL)
    assert (resolve("auto"), resolve("portable")) == ("x86-64-v3", "x86-64-v3")
    host(SANDY_BRIDGE)
    assert (resolve("auto"), resolve("portable")) == ("native", "native")   # no declared level fits
    with pytest.raises(ConfigError, match="unknown cpu_target 'v3'"):
        resolve("v3")
    with pytest.raises(ConfigError, match="cpu_target armv8.2-a.* is for aarch64 machines; this one is x86_64"):
        resolve("armv8.2-a+fp16+dotprod")
    host({"fp", "asimd", "asimdhp", "fphp", "asimddp"}, machine="aarch64")
    assert resolve("portable") == "armv8.2-a+fp16+dotprod"


def test_a_native_build_on_a_cpu_with_bf16_units_runs_bf16_by_default(host):
    """Without a dtype, a build whose CPU code targets this host (native) runs its text encoder and denoiser in bf16
    where the host has bf16 units (AVX512-BF16, AMX); the levels promise none, so every other build stays fp32."""
    from qic.spec import parse_spec
    host(SAPPHIRE_RAPIDS)
    native = dict(parse_spec({"cpu_target": "native"}).dtype)
    assert native["text_encoder"] == native["denoiser"] == "bfloat16" and native["vae_decoder"] == "float32"
    for other in ({}, {"cpu_target": "auto"}, {"cpu_target": "x86-64-v4"}, {"backend": "export"},
                  {"cpu_target": "native", "dtype": "float32"}, {"cpu_target": "native", "device": "cuda"}):
        assert set(dict(parse_spec(other).dtype).values()) == {"float32"}, other
    host(SKYLAKE_X - {"avx512_bf16"})   # AVX-512 without bf16 units
    assert set(dict(parse_spec({"cpu_target": "native"}).dtype).values()) == {"float32"}
    host(HASWELL | {"amx_bf16", "amx_tile"})
    assert dict(parse_spec({"cpu_target": "native"}).dtype)["denoiser"] == "bfloat16"
    host(SANDY_BRIDGE | {"avx512_bf16"})   # no level fits: portable falls back to native, and stays fp32
    assert set(dict(parse_spec({}).dtype).values()) == {"float32"}
    with_conditions = {"cpu_target": "native", "model": "embedded:shapes-edit"}   # condition images: fp32
    assert set(dict(parse_spec(with_conditions).dtype).values()) == {"float32"}


def test_the_backend_identity_records_the_level_alike_on_every_host_of_it(host, monkeypatch):
    from qic.backends.inductor.build import InductorBackend, compile_options
    from qic.spec import parse_spec
    host(SAPPHIRE_RAPIDS)
    v3_here = InductorBackend("cpu", "x86-64-v3").identity()
    native_here = InductorBackend("cpu", "native").identity()
    assert v3_here["target"]["cpu_target"] == "x86-64-v3" and v3_here != native_here   # part of every cache key
    assert InductorBackend.from_spec(parse_spec({})).cpu_target == "x86-64-v3"   # the default
    assert InductorBackend.from_spec(parse_spec({"cpu_target": "auto"})).cpu_target == "x86-64-v4"
    host(HASWELL)
    assert InductorBackend("cpu", "x86-64-v3").identity() == v3_here   # a v3 cache entry serves this host too
    assert InductorBackend("cpu", "native").identity() != native_here
    with pytest.raises(ConfigError, match="cpu_target x86-64-v4 cannot be built on this machine: .*avx512f"):
        InductorBackend("cpu", "x86-64-v4")   # the build loads what it compiles
    assert compile_options("cpu", cpu_target="x86-64-v3")["cpp.march"] == "x86-64-v3"
    assert "cpp.march" not in compile_options("cpu", cpu_target="native")


# ------------------------------------------------------------------------------------------- a real compile

def _this_cpu_runs_v3() -> bool:
    return platform.machine() == "x86_64" and "x86-64-v3" in qic_target.runnable_levels()


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256))

    def forward(self, x):
        return self.net(x)


def _wrappers_mapped() -> set[str]:
    return {line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "wrapper.so" in line}


@pytest.fixture(scope="module")
def v3_graph(tmp_path_factory):
    """One small graph compiled here for x86-64-v3 as a build does: (package, module, weights, maps after)."""
    if not _this_cpu_runs_v3():
        pytest.skip("needs an x86-64 CPU that runs x86-64-v3")
    from qic.backends.base import Traced
    from qic.backends.inductor.build import InductorBackend, WeightsAsInputs
    torch.manual_seed(0)
    module = _Small().eval()
    names = [n for n, _ in module.named_parameters()]
    weights = [p.detach() for p in module.parameters()]
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(module, names), ((torch.randn(8, 64),), weights))
    out = tmp_path_factory.mktemp("v3")
    before = _wrappers_mapped()
    compiled = InductorBackend("cpu", "x86-64-v3").compile(Traced(None, names, program), out)
    return SimpleNamespace(path=out / compiled.file, module=module, weights=weights,
                           new_maps=_wrappers_mapped() - before)


@pytest.mark.slow
def test_a_v3_build_keeps_no_compiled_code_mapped_and_its_kernels_are_avx2(v3_graph):
    # The no-constants check loaded the package in a child: nothing of it stays mapped in the build process.
    assert not v3_graph.new_maps
    with zipfile.ZipFile(v3_graph.path) as z:
        meta = [json.loads(z.read(n)) for n in z.namelist() if n.endswith("wrapper_metadata.json")]
    assert [m["AOTI_CPU_ISA"] for m in meta] == ["AVX2"]   # inductor's vector ISA, pinned to the level's


@pytest.mark.slow
def test_a_v3_graph_compiled_on_any_host_holds_no_avx512_instructions(v3_graph, tmp_path):
    if not shutil.which("objdump"):
        pytest.skip("objdump is not installed")
    with zipfile.ZipFile(v3_graph.path) as z:
        sos = [z.extract(n, tmp_path) for n in z.namelist() if n.endswith(".so")]
    dis = "".join(subprocess.run(["objdump", "-d", so], capture_output=True, text=True, check=True).stdout
                  for so in sos)
    assert "%ymm" in dis and zmm_instructions(dis) == 0


def test_zmm_instructions_are_counted_in_instruction_lines_only():
    # objdump's header names the library's path: compiled under a folder spelled with "zmm", a v3 library's
    # only such line is the header (seen on a fresh clone), which is no instruction.
    dis = ("\n/tmp/pzmmq3/graph.so:     file format elf64-x86-64\n\nDisassembly of section .text:\n\n"
           "0000000000001a40 <kernel_zmm_like>:\n"
           "    1a40:\tc5 fc 10 07          \tvmovups (%rdi),%ymm0\n"
           "    1a44:\te8 00 00 00 00       \tcall   1a49 <kernel_zmm_like>\n")
    assert zmm_instructions(dis) == 0
    # A real AVX-512 instruction is counted, so the v3 check above can fail.
    assert zmm_instructions(dis + "    1a49:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n") == 1


@pytest.mark.slow
def test_a_v3_graph_passes_the_load_check_here_and_matches_eager(v3_graph, tmp_path, host):
    from qic.backends.inductor.build import InductorBackend
    from qic.backends.inductor.load import check, load
    target = InductorBackend("cpu", "x86-64-v3").identity()["target"]
    check(tmp_path, _manifest(target), "cpu")   # this machine
    x = torch.randn(8, 64)
    with torch.no_grad():
        got = load(v3_graph.path, v3_graph.weights, "cpu")([x])[0]
        torch.testing.assert_close(got, v3_graph.module(x), rtol=1e-4, atol=1e-5)
    host(HASWELL)
    check(tmp_path, _manifest(target), "cpu")   # an AVX2-only machine
    host(SANDY_BRIDGE)
    with pytest.raises(BundleError, match=r"compiled for x86-64-v3, which needs .*avx2"):
        check(tmp_path, _manifest(target), "cpu")
