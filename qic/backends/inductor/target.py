"""The machine a compiled graph was made for, and whether this machine can run it. Stdlib + torch only.

AOTInductor compiles CPU code with -march=native plus the vector ISA flags of the build host, so an
artifact compiled on an AVX-512 machine dies with SIGILL on an AVX2 one, and torch only compares its
own recorded ISA after it has loaded the library. qic records the build host's instruction-set flags
with every graph (and in its cache key), and the runtime compares them with this machine's before
loading any compiled code. CUDA artifacts hold code for the build GPU's compute capability only.
"""

from __future__ import annotations

import functools
import os
import platform

# The /proc/cpuinfo flags a compiler may emit instructions for under -march=native or inductor's
# -mavx2/-mavx512*/-mamx-* (scalar extensions too: -march=native uses bmi2, movbe, ...). Flags
# about the kernel, virtualisation or errata are left out: they differ between identical CPUs.
X86_ISA_FLAGS = frozenset("""
    pni ssse3 sse4_1 sse4_2 popcnt movbe abm bmi1 bmi2 adx aes pclmulqdq sha_ni f16c fma avx avx2 avx_vnni
    gfni vaes vpclmulqdq avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2
    avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 amx_fp16
""".split())
ARM_ISA_FLAGS = frozenset("fp asimd asimdhp fphp asimddp i8mm bf16 sve sve2 svebf16 svei8mm sme".split())


@functools.lru_cache(maxsize=1)
def host_isa() -> tuple[str, ...]:
    """This CPU's instruction-set flags that compiled code may depend on (sorted)."""
    wanted = ARM_ISA_FLAGS if platform.machine() in ("aarch64", "arm64") else X86_ISA_FLAGS
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return tuple(sorted(wanted & set(value.split())))
    except OSError:
        pass
    return ()


def host_target(device: str) -> dict:
    """What a graph compiled here for `device` needs of the machine that runs it."""
    target = {"machine": platform.machine(), "isa": list(host_isa()),
              # TORCHINDUCTOR_CPP_MARCH replaces -march=native; the vector ISA flags still come from this host.
              "march": os.environ.get("TORCHINDUCTOR_CPP_MARCH") or "native"}
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
        vector = [f for f in host_isa() if f.startswith(("avx", "amx", "sve", "asimd"))]
        return (f"it was compiled for a CPU with {', '.join(missing)}; this machine's CPU lacks "
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
