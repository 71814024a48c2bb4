"""AWS Neuron back end: each graph lowered to an XLA HloModuleProto (torch-xla), checked on XLA:CPU, then
compiled to a NEFF by `neuronx-cc` where the compiler is installed.

Split in two because the halves need different machines (docs/neuron.md says what has run where):
- lowering and checking run wherever torch-xla does (the repo's `.venv-xla` here): every graph becomes
  `model.hlo_module.pb` with weights as parameters (none of their values inside), executed on XLA:CPU
  against eager PyTorch; the relative L2 error is recorded in the graph's metadata;
- compiling needs `neuronx-cc` (a Trainium host's SDK). Without it the build still lowers and checks
  everything and writes a bundle marked lower-only; the same build on a Trainium host compiles the
  NEFFs, recompiling nothing already in the cache (the lowered graphs are cached by their HLO, the NEFFs
  by HLO digest, compiler version and flags: qic.backends.neuron.cc).

In the back-end interface (qic/backends/base.py): trace = lower the eager module (torch.export's scan op
has no XLA lowering), compile = write the HLO files and check them on XLA:CPU, finish = the NEFFs.

Graph files, in the graph's cache directory and bundle folder:
    model.hlo_module.pb     the HLO module (entry parameters = used graph inputs, then weights, in order)
    params.json             which graph input or weight feeds each HLO parameter
    model.neff              the compiled graph (absent in a lower-only bundle)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import time
import warnings
from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph, Finished, Traced
from qic.backends.neuron import DEVICES, HLO_FILE, NAME, NEFF_FILE, PARAMS_FILE
from qic.errors import CompileError, ConfigError

TARGET = "trn2"
COLLECTIVES = {"all-reduce", "all-gather", "all-to-all"}   # HLO opcodes that need every rank of their groups
# fp32 on both sides; XLA:CPU may reassociate reductions and fuse differently from eager, so errors of a
# few ulps per reduction accumulate through the layers: 1e-5 is ~100 fp32 ulps of relative error, far
# above that and far below what a wrong weight, mask or step constant gives (1e-2 and up, tests).
XLA_CPU_REL_L2 = 1e-5


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


class NeuronBackend(Backend):
    name = NAME

    def __init__(self, device: str, compiler_args: dict | None = None, lnc: int = 1, xla_check: bool = True,
                 world: int = 1):
        if device not in DEVICES:
            raise ConfigError(f"the neuron back end targets device 'neuron', not {device!r}")
        if not xla_available():
            raise ConfigError("the neuron back end lowers graphs with torch-xla, which this Python environment "
                              "does not have",
                              "run `make xla-env` and build with .venv-xla/bin/qic, or pip install torch-xla==2.9.0")
        super().__init__(device)
        from qic.backends.neuron import cc as neuron_cc
        self.compiler_args = dict(compiler_args or {})
        self.lnc = lnc
        self.xla_check = xla_check
        if xla_check and world > 1:   # a multi-rank graph's check runs on `world` XLA:CPU devices (compile)
            from qic.backends.neuron import xla_runtime
            xla_runtime.reserve_devices(world)
        self.compiler, self.compiler_missing = neuron_cc.find()
        self.compiler_version = neuron_cc.version(self.compiler) if self.compiler else None
        for component, args in self.compiler_args.items():   # refuse bad flags before any work
            neuron_cc.component_flags(component, args, lnc=lnc, target=TARGET)

    @classmethod
    def from_spec(cls, spec) -> NeuronBackend:
        return cls(spec.device, compiler_args=dict(spec.compiler_args), lnc=spec.lnc, xla_check=spec.xla_check,
                   world=spec.layout.world)

    def identity(self) -> dict:
        """What the lowered HLO depends on. The compiler's version and flags key the NEFFs instead
        (neuron_cc.cache_key), so a build without the compiler and one with it share the lowering."""
        from importlib.metadata import version
        return {"backend": self.name, "torch": torch.__version__, "torch_xla": version("torch-xla"),
                "device": self.device, "target": TARGET}

    def compiler_identity(self) -> dict:
        return {"neuronx_cc": self.compiler_version, "lnc": self.lnc, "compiler_args": self.compiler_args}

    def flags(self, component: str) -> list[str]:
        from qic.backends.neuron import cc as neuron_cc
        return neuron_cc.component_flags(component, self.compiler_args.get(component), lnc=self.lnc, target=TARGET)

    # ---------------------------------------------------------------------------- lowering

    def trace(self, gdef, tensors: dict) -> Traced:
        """Lower the eager module to HLO (no torch.export); the HLO is what the compiler sees, so its digest
        names the graph. Lowering takes well under a second per graph."""
        from qic.backends.neuron import hlo_proto
        from qic.parallel.tp import tp_size_of
        if gdef.dynamic:
            raise ConfigError(f"graph {gdef.name}: the neuron back end needs fixed text buckets (a NEFF has static "
                              "shapes; exact-length graphs have a dynamic text dimension)",
                              "use text buckets such as 128,256 instead of 0")
        tp = tp_size_of(gdef.module)
        groups = gdef.groups or {"0": [list(range(tp))]}   # plain TP: the world group
        lowered = self.lower(gdef.module, gdef.inputs, tensors, groups)
        # The ranks its collectives span: a graph without any (the VAE, a TP 1 step) checks on one device.
        collective = set(hlo_proto.opcodes(lowered.proto)) & COLLECTIVES
        ranks = 1 + max(r for g in groups.values() for group in g for r in group) if collective else 1
        # Multi-rank entries made before their build-time check existed hold no check: a new key re-checks them.
        salt = b"qic-hlo-v1" + (b"-ranks-checked" if ranks > 1 else b"")
        digest = hashlib.sha256(salt + hashlib.sha256(lowered.proto).digest())
        # Scalars torch-xla made parameters travel with the graph, after its weights.
        return Traced(digest, list(tensors) + list(lowered.constants), (lowered, gdef, tensors, ranks, groups),
                      constants=dict(lowered.constants))

    def compile(self, traced: Traced, out_dir: Path) -> CompiledGraph:
        """Write the HLO files, then execute them on XLA:CPU against eager (fp32: rel-L2 <= XLA_CPU_REL_L2;
        bf16: see check()); a graph beyond its bound fails the build. A graph with collectives runs at every
        rank of its world, one XLA:CPU device each, against eager PyTorch at as many ranks."""
        lowered, gdef, tensors, ranks, groups = traced.payload
        compiled = self.write(lowered, traced.weight_names, [n for n, _ in gdef.inputs], out_dir)
        checks = {"xla_cpu_rel_l2": None, "tp": ranks}
        skipped = check_skipped(self.xla_check, ranks, tensors)
        if skipped:
            checks["xla_cpu_check"] = skipped
        else:
            result = self.check(lowered, gdef.module, gdef.inputs, tensors, groups, ranks, sample=gdef.sample)
            if not result.pop("ok"):
                raise CompileError(f"graph {gdef.name}: lowered HLO on XLA:CPU differs from eager PyTorch "
                                   f"beyond its bound ({result['bound']}; rel-L2 "
                                   f"{result['xla_cpu_rel_l2']:.3g})", "report this as a qic bug")
            checks.update({k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in result.items()})
        compiled.meta = {"checks": checks, "hlo": {"bytes": len(lowered.proto),
                                                   "parameters": len(lowered.param_order)}}
        return compiled

    def finish(self, artifacts: list, cache_dir: Path, progress=None) -> Finished:
        """NEFFs for the lowered graphs, compiled in parallel processes where neuronx-cc is installed; without
        it, one warning and the artifacts unchanged (the bundle is then marked lower-only)."""
        from qic.backends.neuron import cc as neuron_cc
        from qic.cache import layout
        from qic.manifest import sha256_file
        if self.compiler is None:
            return Finished(artifacts, warnings=[f"no NEFFs: {self.compiler_missing}; the bundle is lower-only "
                                                 f"({checked_summary(artifacts)}); the same build on a Trainium "
                                                 "host compiles it"])
        # Each NEFF lives under its own cache key (HLO digest, compiler version, canonical flags), so a
        # compiler upgrade or new flags never overwrite a NEFF another build uses.
        jobs, hits = [], []
        for art in artifacts:
            flags = tuple(self.flags(art.meta["component"]))
            key = neuron_cc.cache_key(art.meta["files"][HLO_FILE]["sha256"], self.compiler_version, flags)
            jobs.append(neuron_cc.CompileJob(art.directory / HLO_FILE, layout.neff_dir(cache_dir, key), flags))
            hits.append(neuron_cc.cached(jobs[-1].out_dir, key))
        if progress:
            progress("neff", f"{len(jobs) - sum(hits)} graphs", None)
        t = time.perf_counter()
        neffs = neuron_cc.compile_many(jobs, compiler=self.compiler)
        out, rows = [], []
        for art, job, neff, hit in zip(artifacts, jobs, neffs, hits):
            meta = {**art.meta, "neff": {"path": str(neff), "sha256": sha256_file(neff),
                                         "bytes": neff.stat().st_size, "flags": list(job.args),
                                         "compiler": self.compiler_version}}
            out.append(dataclasses.replace(art, meta=meta))
            rows.append(("neff", art.meta["graph"], hit, neff.stat().st_size, time.perf_counter() - t))
        return Finished(out, rows)

    def graph_fields(self, meta: dict, folder: str) -> tuple[dict, list[tuple[Path, str]]]:
        neff = meta.get("neff")
        fields = {"hlo": f"{folder}/{meta['file']}", "params": f"{folder}/{PARAMS_FILE}",
                  "neff": f"{folder}/{NEFF_FILE}" if neff else None, "checks": meta.get("checks", {}),
                  "hlo_bytes": meta["hlo"]["bytes"],
                  "compiler": {"flags": neff["flags"], "neuronx_cc": neff["compiler"]} if neff else None}
        return fields, [(Path(neff["path"]), NEFF_FILE)] if neff else []

    def bundle_fields(self, graphs: list[dict]) -> dict:
        return {"lower_only": any(not g["neff"] for g in graphs), "neuron": self.compiler_identity()}

    def lower(self, module: torch.nn.Module, inputs: list, tensors: dict, groups: dict):
        from qic.backends.neuron import lower as xla_lower
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return xla_lower.lower(module, inputs, tensors, groups=groups)

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
        return CompiledGraph(file=HLO_FILE, extra_files=[PARAMS_FILE])

    def check(self, lowered, module: torch.nn.Module, inputs: list, tensors: dict, groups: dict | None = None,
              ranks: int = 1, sample=None) -> dict:
        """The HLO executed on XLA:CPU against the eager module, on inputs drawn so every input matters
        (random activations, random token ids, a partly padded mask), or the graph's own `sample()` where its
        definition gives one (GraphDef.sample: inputs that must agree with each other). With ranks > 1, rank
        r's HLO runs on XLA:CPU device r with rank r's weights and mesh coordinates, all ranks at once so the
        collectives really combine them, against eager PyTorch at the same ranks (qic.backends.neuron.ranks); every
        figure is the worst over the ranks and outputs. {"xla_cpu_rel_l2", "xla_cpu_max_abs", "ok", "bound",
        "xla_cpu_ranks"}.

        fp32: rel-L2 against eager <= XLA_CPU_REL_L2. bf16/fp16: XLA and eager round differently, so
        each is compared with the module run in fp32, and XLA's error may be at most twice eager's own
        (both are one sample of the same low-precision rounding noise) plus the fp32 allowance. max-abs is
        recorded, not bounded: its scale is the output's (latents, hidden states, pixels), rel-L2's is not.
        """
        sample = sample() if sample is not None else check_inputs(inputs, tensors)
        if [n for n, _ in sample] != [n for n, _ in inputs]:
            raise CompileError(f"the check's sample names {[n for n, _ in sample]}, the graph takes "
                               f"{[n for n, _ in inputs]}", "report this as a qic bug")
        per_rank = [(rank_weights(tensors, r), rank_sample(sample, groups, r)) for r in range(ranks)]
        got = _execute(lowered, per_rank)
        want = _eager(module, per_rank, groups)
        rel = _worst(_rel, got, want)
        figures = {"xla_cpu_rel_l2": rel, "xla_cpu_max_abs": _worst(_max_abs, got, want), "xla_cpu_ranks": ranks,
                   "xla_cpu_check": (f"{ranks} ranks on {ranks} XLA:CPU devices vs eager at {ranks} ranks"
                                     if ranks > 1 else "one XLA:CPU device vs eager")}
        if not any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors.values()):
            return {**figures, "ok": rel <= XLA_CPU_REL_L2, "bound": f"rel-L2 <= {XLA_CPU_REL_L2}"}
        ref = _eager(module, [(_wide(w), [(n, t.float() if t.is_floating_point() else t) for n, t in x])
                              for w, x in per_rank], groups)
        xla_err, eager_err = _worst(_rel, got, ref), _worst(_rel, want, ref)
        return {**figures, "xla_cpu_rel_l2_vs_fp32": xla_err, "eager_rel_l2_vs_fp32": eager_err,
                "ok": xla_err <= 2 * eager_err + XLA_CPU_REL_L2,
                "bound": f"vs fp32: XLA {xla_err:.3g} <= 2 x eager {eager_err:.3g} + {XLA_CPU_REL_L2}"}


BACKEND = NeuronBackend


def _execute(lowered, per_rank: list) -> list[list[torch.Tensor]]:
    from qic.backends.neuron import lower as xla_lower
    values = [lowered.values(sample, tensors) for tensors, sample in per_rank]
    if len(values) == 1:
        return [xla_lower.execute(lowered.proto, values[0])]
    try:
        return xla_lower.execute_ranks(lowered.proto, values)
    except RuntimeError as e:   # too few devices: torch-xla started before the backend could ask for more
        raise CompileError(f"XLA:CPU check of a {len(values)}-rank graph: {e}",
                           f"set CPU_NUM_DEVICES={len(values)} for the build, or build with xla_check: false") from e


def _eager(module: torch.nn.Module, per_rank: list, groups: dict | None) -> list[list[torch.Tensor]]:
    if len(per_rank) == 1:
        tensors, sample = per_rank[0]
        with torch.no_grad():
            out = torch.func.functional_call(module, tensors, tuple(t for _, t in sample))
        return [list(out) if isinstance(out, (tuple, list)) else [out]]
    from qic.backends.neuron.ranks import run_ranks
    return run_ranks(module, per_rank, groups)


def _wide(tensors: dict) -> dict:
    return {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}


def _worst(measure, got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> float:
    """The largest figure over ranks and outputs; NaN if any is (Python's max would skip a NaN that is not first)."""
    values = [measure(g, w) for got_r, want_r in zip(got, want) for g, w in zip(got_r, want_r)]
    return float("nan") if any(v != v for v in values) else max(values)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.detach().float()).abs().max().item()


def rank_weights(tensors: dict, rank: int) -> dict:
    """Rank r's weights for the check: rank 0's as bound (its real shard), rank r > 0's floating tensors
    scaled elementwise by a seeded factor in [0.75, 1.25]. The ranks must differ, or a collective over the
    wrong group (or none) would sum equal parts and go unseen; the HLO and eager get the same weights, so
    the check compares the lowering, whatever the values."""
    if rank == 0:
        return tensors
    gen = torch.Generator().manual_seed(1000 + rank)
    return {n: (t.float() * (0.75 + 0.5 * torch.rand(t.shape, generator=gen))).to(t.dtype)
            if t.is_floating_point() else t for n, t in tensors.items()}


def rank_sample(sample: list, groups: dict | None, rank: int) -> list:
    """The check's inputs at rank r: its mesh coordinates where the graph takes them (cfg_rank, sp_rank:
    r's place in its group along that axis), the rest as drawn."""
    from qic.parallel.mesh import ALIASES, RANK_INPUTS
    out = []
    for name, t in sample:
        if name in RANK_INPUTS:
            group = next(g for g in (groups or {})[ALIASES[RANK_INPUTS[name]]] if rank in g)
            t = torch.tensor([group.index(rank)], dtype=t.dtype)
        out.append((name, t))
    return out


def check_skipped(xla_check: bool, ranks: int, tensors: dict) -> str | None:
    """Why a graph is not executed on XLA:CPU at build (its manifest's xla_cpu_check), or None: it is."""
    narrow = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()
                     if t.is_floating_point() and t.dtype != torch.float32})
    if not xla_check:
        return "not run (xla_check: false)"
    if ranks > 1 and narrow:
        # XLA:CPU's collectives take no bf16 ("AllReduce for datatype 'bf16' is not supported", torch-xla 2.9;
        # inside a While it crashed the process): such a graph is lowered, not executed here.
        return f"not run: {ranks}-rank {'/'.join(narrow)} graph (XLA:CPU has no {'/'.join(narrow)} collectives)"
    return None


def checked_summary(artifacts: list) -> str:
    """What the build checked, for the lower-only warning: how many graphs ran on XLA:CPU against eager
    and at how many ranks, and which were not checked."""
    by_ranks: dict[int, int] = {}
    unchecked = []
    for art in artifacts:
        checks = art.meta.get("checks", {})
        if checks.get("xla_cpu_rel_l2") is None:
            unchecked.append(art.meta["graph"])
        else:
            ranks = checks.get("xla_cpu_ranks", 1)
            by_ranks[ranks] = by_ranks.get(ranks, 0) + 1
    parts = [f"{n} on one XLA:CPU device" if r == 1 else f"{n} at {r} ranks on {r} XLA:CPU devices"
             for r, n in sorted(by_ranks.items())]
    checked = sum(by_ranks.values())
    text = (f"{checked} of {len(artifacts)} graphs executed on XLA:CPU and matched eager PyTorch "
            f"({', '.join(parts)})" if checked else f"none of the {len(artifacts)} graphs checked on XLA:CPU")
    if unchecked:
        why = next(a.meta.get("checks", {}).get("xla_cpu_check", "no check recorded") for a in artifacts
                   if a.meta["graph"] == unchecked[0])
        text += f"; not checked: {', '.join(unchecked)} ({why})"
    return text


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
        elif name == "row":                            # step caching's mixed graph: the row that computes, of
            v = torch.ones_like(t)                     # two or more (row 1: the uncond row of one image)
        elif t.dim() == 0:
            v = t.clone()                              # timestep, sigmas, guidance: the example values
        else:
            v = torch.randn(t.shape, generator=gen).to(t.dtype)
        out.append((name, v))
    return out
