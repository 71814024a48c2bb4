"""Load a weight-free AOTInductor package and bind memory-mapped weights without copying them.

Uses torch's C++ package loader directly: the Python route (torch._inductor.aoti_load_package)
imports the whole compiler (about 2 s) before loading. This binding is internal torch API, which is
why pyproject bounds torch to a tested range; tests/test_runtime_*.py exercise it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from qic.errors import BundleError


def load(path: Path, constants: Mapping[str, torch.Tensor], device: str):
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    expected = set(loader.get_constant_fqns())
    missing = sorted(expected - set(constants))
    if missing:
        raise BundleError(f"{path}: weights missing for graph constants: {', '.join(missing[:5])}")
    bound = {k: (v if v.device.type == device else v.to(device)) for k, v in constants.items() if k in expected}
    # Running before constants are bound crashes the process: bind first, always.
    # Arguments: use_inactive=False, check_full_update=True, user_managed=True (no copy).
    loader.load_constants(bound, False, True, True)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return loader.run(inputs)

    run.loader = loader  # keep the loader (and the bound tensors it references) alive
    run.bound = bound
    return run
