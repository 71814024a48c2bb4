"""The machine a compiled graph was made for, and whether this machine can run it. Stdlib + torch only.

AOTInductor compiles CPU code (a CUDA graph's host wrapper too) with -march=native plus the vector ISA
flags of the build host, so by default an artifact compiled on an AVX-512 machine dies with SIGILL on an
AVX2 one, and torch only compares its own recorded ISA after it has loaded the library. qic compiles
for a declared CPU target instead (`cpu_target`): an x86-64 micro-architecture level, with inductor's
vector kernels pinned to that level's width (build.py), records the flags the level requires, and the
runtime compares them with this machine's before loading any compiled code. `native` keeps torch's
behaviour: the build host's own flags are recorded and required. CUDA artifacts hold code for the build
GPU's compute capability only.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    """A portable CPU target: -march=`march`, inductor's vector kernels `vec` wide, needing `flags`."""
    machine: str
    march: str
    vec: str                  # inductor's vector ISA for the kernels: avx2, avx512, asimd (NEON)
    flags: frozenset


_V2 = frozenset("cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3".split())
_V3 = _V2 | frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())   # abm: LZCNT in /proc/cpuinfo
_V4 = _V3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())
# The levels qic can compile for, in /proc/cpuinfo's names. The aarch64 one is NEON with fp16 and dot
# product (Neoverse N1, Graviton 2 and later); it is declared here but has not been run on an ARM host.
LEVELS = {
    "x86-64-v3": Level("x86_64", "x86-64-v3", "avx2", _V3),
    "x86-64-v4": Level("x86_64", "x86-64-v4", "avx512", _V4),
    "armv8.2-a+fp16+dotprod": Level("aarch64", "armv8.2-a+fp16+dotprod", "asimd",
                                    frozenset("fp asimd asimdhp fphp asimddp".split())),
}
# native: the build host's -march=native and its flags; auto: the highest level this host can run;
# portable: the lowest (x86-64-v3 on x86), so that artifacts serve every machine of that level.
CPU_TARGETS = ("native", "auto", "portable", *LEVELS)
# The default for builds and warms: docs/benchmarks.md, "CPU targets", has the figures behind it.
DEFAULT_CPU_TARGET = "portable"

# The /proc/cpuinfo flags a compiler may emit instructions for under -march=native or inductor's
# -mavx2/-mavx512*/-mamx-* (scalar extensions too: -march=native uses bmi2, movbe, ...), and those the
# levels name. Flags about the kernel, virtualisation or errata are left out: they differ between
# identical CPUs.
X86_ISA_FLAGS = frozenset("""
    pni ssse3 sse4_1 sse4_2 popcnt movbe abm bmi1 bmi2 adx aes pclmulqdq sha_ni f16c fma avx avx2 avx_vnni
    gfni vaes vpclmulqdq avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2
    avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 amx_fp16
""".split()) | _V4
ARM_ISA_FLAGS = frozenset("fp asimd asimdhp fphp asimddp i8mm bf16 sve sve2 svebf16 svei8mm sme".split())


def _machine() -> str:
    m = platform.machine()
    return {"arm64": "aarch64", "AMD64": "x86_64"}.get(m, m)


@functools.lru_cache(maxsize=1)
def host_isa() -> tuple[str, ...]:
    """This CPU's instruction-set flags that compiled code may depend on (sorted)."""
    wanted = ARM_ISA_FLAGS if _machine() == "aarch64" else X86_ISA_FLAGS
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return tuple(sorted(wanted & set(value.split())))
    except OSError:
        pass
    return ()


def runnable_levels() -> list[str]:
    """The levels this machine's CPU can run, lowest first."""
    return [n for n, lv in LEVELS.items() if lv.machine == _machine() and lv.flags <= set(host_isa())]


def resolve_cpu_target(name: str | None = None) -> str:
    """The target a build compiles CPU code for: `name` (a build's cpu_target), else the default; `auto` and
    `portable` become a level this host can run, or native where none fits."""
    from qic.errors import ConfigError
    name = name or DEFAULT_CPU_TARGET
    if name not in CPU_TARGETS:
        raise ConfigError(f"unknown cpu_target {name!r}; known: {', '.join(CPU_TARGETS)}",
                          "set cpu_target (or --cpu-target) to one of them")
    if name in ("auto", "portable"):
        fits = runnable_levels()
        return (fits[-1] if name == "auto" else fits[0]) if fits else "native"
    if name != "native" and LEVELS[name].machine != _machine():
        here = [n for n, lv in LEVELS.items() if lv.machine == _machine()]
        raise ConfigError(f"cpu_target {name} is for {LEVELS[name].machine} machines; this one is {_machine()}",
                          f"use one of: {', '.join(['native', 'auto', 'portable', *here])}")
    return name


def host_target(device: str, cpu_target: str = "native") -> dict:
    """What a graph compiled here for `device` and the (resolved) `cpu_target` needs of the machine that runs it."""
    if cpu_target == "native":
        target = {"machine": platform.machine(), "cpu_target": "native", "isa": list(host_isa()),
                  # TORCHINDUCTOR_CPP_MARCH replaces -march=native; the vector ISA flags still come from this host.
                  "march": os.environ.get("TORCHINDUCTOR_CPP_MARCH") or "native"}
    else:
        level = LEVELS[cpu_target]
        target = {"machine": platform.machine(), "cpu_target": cpu_target, "isa": sorted(level.flags),
                  "march": level.march}
    if device == "cuda":
        import torch
        target["capability"] = list(torch.cuda.get_device_capability())
    return target


def target_mismatch(target: dict | None, device: str) -> str | None:
    """Why this machine cannot run code compiled for `target`, as one line; None when it can."""
    if not target:
        return "it records no target machine (built by an older qic)"
    here = platform.machine()
    if target.get("machine") != here:
        return f"it was compiled for {target.get('machine')}, this machine is {here}"
    missing = sorted(set(target.get("isa", ())) - set(host_isa()))
    if missing:
        level = target.get("cpu_target")
        vector = [f for f in host_isa() if f.startswith(("avx", "amx", "sve", "asimd"))]
        what = f"{level}, which needs" if level in LEVELS else "a CPU with"
        return (f"it was compiled for {what} {', '.join(missing)}; this machine's CPU lacks "
                f"{'it' if len(missing) == 1 else 'them'} (it has {', '.join(vector) or 'no vector extensions'})")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return f"it was compiled for CUDA compute capability {target.get('capability')}, this machine has no GPU"
        have = list(torch.cuda.get_device_capability())
        if target.get("capability") != have:
            cap = ".".join(map(str, target.get("capability") or ["?"]))
            return f"it was compiled for CUDA compute capability {cap}, this GPU is {'.'.join(map(str, have))}"
    return None
