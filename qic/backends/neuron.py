"""AWS Neuron back end: each graph lowered to an XLA HloModuleProto (torch-xla), checked on XLA:CPU, then
compiled to a NEFF by `neuronx-cc` where the compiler is installed.

Split in two because the halves need different machines (docs/neuron.md says what has run where):
- lowering and checking run wherever torch-xla does (the repo's `.venv-xla` here): every graph becomes
  `model.hlo_module.pb` with weights as parameters (none of their values inside), executed on XLA:CPU
  against eager PyTorch; the relative L2 error is recorded in the graph's metadata;
- compiling needs `neuronx-cc` (a Trainium host's SDK). Without it the build still lowers and checks
  everything and writes a bundle marked lower-only; the same build on a Trainium host compiles the
  NEFFs, recompiling nothing already in the cache (the lowered graphs are cached by their HLO, the NEFFs
  by HLO digest, compiler version and flags: qic.backends.neuron_cc).

Graph files, in the graph's cache directory and bundle folder:
    model.hlo_module.pb     the HLO module (entry parameters = used graph inputs, then weights, in order)
    params.json             which graph input or weight feeds each HLO parameter
    model.neff              the compiled graph (absent in a lower-only bundle)
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph
from qic.errors import ConfigError

HLO_FILE = "model.hlo_module.pb"
PARAMS_FILE = "params.json"
TARGET = "trn2"
# fp32 on both sides; XLA:CPU may reassociate reductions and fuse differently from eager, so errors of a
# few ulps per reduction accumulate through the layers: 1e-5 is ~100 fp32 ulps of relative error, far
# above that and far below what a wrong weight, mask or step constant gives (1e-2 and up, tests).
XLA_CPU_REL_L2 = 1e-5


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


class NeuronBackend(Backend):
    name = "neuron"
    traces_modules = True   # lowers the eager module itself (torch.export's scan op has no XLA lowering)

    def __init__(self, device: str, compiler_args: dict | None = None, lnc: int = 1, xla_check: bool = True):
        if device != "neuron":
            raise ConfigError(f"the neuron back end targets device 'neuron', not {device!r}")
        if not xla_available():
            raise ConfigError("the neuron back end lowers graphs with torch-xla, which this Python environment "
                              "does not have",
                              "run `make xla-env` and build with .venv-xla/bin/qic, or pip install torch-xla==2.9.0")
        super().__init__(device)
        from qic.backends import neuron_cc
        self.compiler_args = dict(compiler_args or {})
        self.lnc = lnc
        self.xla_check = xla_check
        self.compiler, self.compiler_missing = neuron_cc.find()
        self.compiler_version = neuron_cc.version(self.compiler) if self.compiler else None
        for component, args in self.compiler_args.items():   # refuse bad flags before any work
            neuron_cc.component_flags(component, args, lnc=lnc, target=TARGET)

    def identity(self) -> dict:
        """What the lowered HLO depends on. The compiler's version and flags key the NEFFs instead
        (neuron_cc.cache_key), so a build without the compiler and one with it share the lowering."""
        from importlib.metadata import version
        return {"backend": self.name, "torch": torch.__version__, "torch_xla": version("torch-xla"),
                "device": self.device, "target": TARGET}

    def compiler_identity(self) -> dict:
        return {"neuronx_cc": self.compiler_version, "lnc": self.lnc, "compiler_args": self.compiler_args}

    def flags(self, component: str) -> list[str]:
        from qic.backends import neuron_cc
        return neuron_cc.component_flags(component, self.compiler_args.get(component), lnc=self.lnc, target=TARGET)

    def compile(self, program, out_dir: Path) -> CompiledGraph:
        raise TypeError("the neuron back end lowers modules (lower()), not exported programs")

    # ---------------------------------------------------------------------------- lowering

    def lower(self, module: torch.nn.Module, inputs: list, tensors: dict, tp: int):
        from qic.backends import xla_lower
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return xla_lower.lower(module, inputs, tensors, tp=tp)

    def write(self, lowered, weight_inputs: list[str], input_names: list[str], out_dir: Path) -> CompiledGraph:
        """Write the lowered graph's files; params.json maps HLO parameters to the runtime's lists."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / HLO_FILE).write_bytes(lowered.proto)
        # Constants torch-xla made are appended to the weights (weight_inputs holds them).
        index = {("input", n): i for i, n in enumerate(input_names)}
        index.update({("weight", n): i for i, n in enumerate(weight_inputs)})
        kinds = ["input" if p["kind"] == "input" else "weight" for p in lowered.param_order]
        params = [[k, index[(k, p["name"])]] for k, p in zip(kinds, lowered.param_order)]
        (out_dir / PARAMS_FILE).write_text(json.dumps({"params": params, "outputs": lowered.outputs}) + "\n")
        return CompiledGraph(file=HLO_FILE, meta={"extra_files": [PARAMS_FILE]})

    def check(self, lowered, module: torch.nn.Module, inputs: list, tensors: dict) -> dict:
        """The HLO executed on XLA:CPU against the eager module, on inputs drawn so every input matters
        (random activations, random token ids, a partly padded mask). {"xla_cpu_rel_l2", "ok", "bound"}.

        fp32: rel-L2 against eager <= XLA_CPU_REL_L2. bf16/fp16: XLA and eager round differently, so
        each is compared with the module run in fp32, and XLA's error may be at most twice eager's own
        (both are one sample of the same low-precision rounding noise) plus the fp32 allowance.
        """
        from qic.backends import xla_lower
        sample = check_inputs(inputs, tensors)
        got = xla_lower.execute(lowered.proto, lowered.values(sample, tensors))
        want = _run(module, tensors, sample)
        rel = max(_rel(g, w) for g, w in zip(got, want))
        if not any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors.values()):
            return {"xla_cpu_rel_l2": rel, "ok": rel <= XLA_CPU_REL_L2, "bound": f"rel-L2 <= {XLA_CPU_REL_L2}"}
        wide = {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}
        ref = _run(module, wide, [(n, t.float() if t.is_floating_point() else t) for n, t in sample])
        xla_err = max(_rel(g, r) for g, r in zip(got, ref))
        eager_err = max(_rel(w, r) for w, r in zip(want, ref))
        return {"xla_cpu_rel_l2": rel, "xla_cpu_rel_l2_vs_fp32": xla_err, "eager_rel_l2_vs_fp32": eager_err,
                "ok": xla_err <= 2 * eager_err + XLA_CPU_REL_L2,
                "bound": f"vs fp32: XLA {xla_err:.3g} <= 2 x eager {eager_err:.3g} + {XLA_CPU_REL_L2}"}


def _run(module: torch.nn.Module, tensors: dict, sample: list) -> list:
    with torch.no_grad():
        out = torch.func.functional_call(module, tensors, tuple(t for _, t in sample))
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_inputs(inputs: list, tensors: dict) -> list:
    """Inputs for the XLA:CPU check, seeded: the example inputs are zeros and ones, which would hide a
    wrong mask or a swapped input."""
    gen = torch.Generator().manual_seed(0)
    vocab = next((t.shape[0] for n, t in tensors.items() if n.endswith("embed_tokens.weight")), None)
    out = []
    for name, t in inputs:
        if name == "input_ids":
            v = torch.randint(0, vocab or 2, t.shape, generator=gen)
        elif name in ("attention_mask", "text_mask"):
            v = torch.ones_like(t)
            v[..., -max(1, t.shape[-1] // 4):] = 0   # a padded tail: masking must matter
            v[..., 0] = 1
        elif t.dim() == 0:
            v = t.clone()                              # timestep, sigmas, guidance: the example values
        else:
            v = torch.randn(t.shape, generator=gen).to(t.dtype)
        out.append((name, v))
    return out
