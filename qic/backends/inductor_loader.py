"""Load an AOTInductor package whose weights are trailing inputs, and bind memory-mapped tensors.

Uses torch's C++ package loader directly: the Python route (torch._inductor.aoti_load_package)
imports the whole compiler (about 2 s) before loading. This binding is internal torch API, which is
why pyproject bounds torch to a tested range; the runtime tests exercise it.
"""

from __future__ import annotations

from pathlib import Path

import torch

# torch (major, minor) series the runtime tests have loaded AOTInductor packages with; `qic doctor`
# reports whether the running torch is one of them.
TESTED_TORCH = ((2, 13),)


def load(path: Path, weights: list[torch.Tensor], device: str):
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    bound = [w if w.device.type == device else w.to(device) for w in weights]

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return loader.run(list(inputs) + bound)

    run.loader = loader
    return run
