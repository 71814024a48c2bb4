"""The lowering environment's packages (`make xla-env`), less the GPU-only ones lowering never loads.

The index's torch 2.9 for x86_64 is the CUDA build: triton and fifteen nvidia-* wheels come with it, ~5 GB of the
~7 GB environment, and a CI run ran out of disk installing them. Lowering to HLO on XLA:CPU runs no CUDA, but
`import torch` loads libtorch_cuda.so, whose NEEDED entries name most of those libraries, so those stay. These
are never loaded on a CPU (~1.2 GB):
- triton: imported only to compile GPU kernels;
- nvidia-cusolver-cu12: named only by libtorch_cuda_linalg.so, which torch opens at the first CUDA linear-algebra
  call;
- nvidia-cuda-nvrtc-cu12: named only by libcaffe2_nvrtc.so, opened at the first runtime-compiled CUDA kernel
  (torch's import preloads nvrtc where it is installed and goes on where it is not);
- nvidia-nvtx-cu12: named by no library of torch 2.9.

Reads pip's installation report (`pip install --dry-run --report FILE`) and prints name==version for each package
to install but those and the project itself, for `pip install --no-deps -r`.
"""
import json
import sys

NEVER_LOADED_ON_CPU = {"triton", "nvidia-cusolver-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-nvtx-cu12"}


def requirements(report: dict) -> list[str]:
    pins = []
    for item in report["install"]:
        meta = item["metadata"]
        name = meta["name"].lower().replace("_", "-")
        if name in NEVER_LOADED_ON_CPU or item["download_info"].get("dir_info", {}).get("editable"):
            continue
        pins.append(f"{name}=={meta['version']}")
    return sorted(pins)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(requirements(json.load(f))))
