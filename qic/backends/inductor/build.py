"""The inductor back end's build half: torch.export traces each graph, AOTInductor compiles it into one
weight-free .pt2 package (weights are trailing inputs: why in qic/builder/compile.py), for CPU or CUDA."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from unittest import mock

import torch

from qic.backends.base import Backend, CompiledGraph, Traced
from qic.backends.inductor import DEVICES, NAME, passes_digest
from qic.backends.inductor.target import LEVELS, host_target, resolve_cpu_target, target_mismatch
from qic.errors import ConfigError

# Weights reach the graph as inputs (see qic/builder/compile.py), so the package holds no weights to leave out.
# These configs are part of every cache key.
# Line tables (-g1 on every C++ file) only serve profilers that map samples to generated source lines; without
# them a tiny graph's package was 2.6x smaller with its wrapper at -O1 (2.0 MB -> 0.78 MB; at -O0, below, 2.1-2.3 MB)
# and compiles 0.5 s sooner. Symbols stay.
INDUCTOR_CONFIGS: dict = {"aot_inductor.enable_line_tables": False}

# A CPU graph's host wrapper (the C++ that calls its kernels; the kernels stay at -O3) at -O0, not AOTInductor's
# -O1: measured on the tiny model, 1.8 s less compiling a graph (about a tenth) and per-step times equal within
# 1% (400 steps: 3.59/3.61 s against 3.58/3.58 s, where the calls weigh most against the compute). CUDA graphs
# keep -O1: their wrapper launches every kernel.
CPU_GRAPH_CONFIGS: dict = {"aot_inductor.compile_wrapper_opt_level": "O0"}


def graph_configs(device: str) -> dict:
    """The configs every graph for `device` is compiled with (part of its cache key)."""
    return INDUCTOR_CONFIGS | (CPU_GRAPH_CONFIGS if device == "cpu" else {})


def takes_qic_passes(device: str) -> bool:
    """Whether graphs on `device` get qic's own passes (CPU graphs: why in passes.py). The one
    place that decides, read by compile_options (which installs them) and identity (which keys on them)."""
    return device == "cpu"


# A graph with collectives gets no buffer reuse and no in-place buffers. Otherwise inductor may hand a
# collective's output buffer on to a graph output (seen: the CFG-parallel step returned the buffer of its last
# all_gather). The gloo work that filled it still holds it, and frees it from its worker thread after the run
# has returned it to Python: freeing a tensor with a Python object takes the GIL, which the next run holds
# while it waits for that worker's queue lock. Deadlock (docs/parallelism.md, "Why compile on a fake group").
COLLECTIVE_GRAPH_CONFIGS: dict = {"allow_buffer_reuse": False, "inplace_buffers": False}


def has_collectives(program) -> bool:
    """Whether an exported program calls a functional collective (TP, Ulysses, CFG-parallel graphs)."""
    return any(n.op == "call_function" and str(n.target).startswith("_c10d_functional.")
               for n in program.graph.nodes)


def compile_options(device: str, passes: bool = True, cpu_target: str = "native", collectives: bool = False) -> dict:
    """The inductor configs qic compiles a graph with on `device` (passes=False: without qic's pass, for
    the before/after of benchmarks.step_profile) for a resolved `cpu_target` (target.py); `collectives`: the
    graph has some (COLLECTIVE_GRAPH_CONFIGS)."""
    options = graph_configs(device) | (COLLECTIVE_GRAPH_CONFIGS if collectives else {})
    if passes and takes_qic_passes(device):
        from qic.backends.inductor.passes import UnfuseCpuBiasAddmm
        options["post_grad_custom_post_pass"] = UnfuseCpuBiasAddmm()
    if cpu_target != "native":
        options["cpp.march"] = LEVELS[cpu_target].march   # replaces -march=native (also in inductor's cache key)
    return options


@contextlib.contextmanager
def pinned_vector_isa(cpu_target: str):
    """Inductor's vector kernels at the level's width while compiling for it. Inductor picks the widest
    vector ISA the build host has and adds that ISA's -m flags after -march: on an AVX-512 host an
    x86-64-v3 graph would get zmm kernels, and even plain AVX-512 gets -mavx512bf16 where the host has
    it, which x86-64-v4 does not include. Inductor asks cpu_vec_isa.valid_vec_isa_list() for the ISAs it
    may use (torch internals; check_torch pins the series), so that list becomes the level's one."""
    if cpu_target == "native":
        yield
        return
    from torch._inductor import cpu_vec_isa

    class LevelAVX512(cpu_vec_isa.VecAVX512):
        """AVX-512 F/CD/BW/DQ/VL only: without the bf16 extension torch adds where the host has it."""
        def build_arch_flags(self) -> str:
            return self._arch_flags

        def is_avx512_bf16_supported(self) -> bool:
            return False

    isa = {"avx2": cpu_vec_isa.VecAVX2, "avx512": LevelAVX512, "asimd": cpu_vec_isa.VecNEON}[LEVELS[cpu_target].vec]()
    # bool(isa): inductor's own check that this compiler and torch build that ISA's kernels; scalar if not.
    with mock.patch.object(cpu_vec_isa, "valid_vec_isa_list", lambda: [isa] if isa else []):
        yield


# AOTInductor writes a C++ function per graph input that checks its dtype, device, sizes and strides, and runs
# them only when AOTI_RUNTIME_CHECK_INPUTS is set. qic's graphs take their weights as inputs (a real denoiser:
# over a thousand), so these never-run checks are most of each graph's host wrapper: on a tiny VAE decoder they
# are 7,400 of its 9,800 lines and 5 of the 11.5 s its wrapper takes to compile. The runtime feeds each graph
# exactly the tensors the bundle's manifest was verified against, so qic's graphs are compiled without them; the
# switch that turns on the other runtime checks (sizes of intermediates) is kept as torch writes it.
INPUT_CHECKS_STUB = """
static bool _check_aoti_runtime_check_inputs_env() {
    const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
    const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
    return result;
}
AOTI_NOINLINE static void __check_inputs_outputs(AtenTensorHandle*, AtenTensorHandle*) {}
"""


@contextlib.contextmanager
def without_input_checks():
    """AOTInductor's per-input checks left out of the wrapper it writes (INPUT_CHECKS_STUB says why). Torch
    internals: check_torch pins the series this was read from."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    def stub(wrapper) -> None:
        wrapper.prefix.splice_aot(INPUT_CHECKS_STUB)

    with mock.patch.object(CppWrapperCpu, "generate_input_output_runtime_checks", stub):
        yield


class InductorBackend(Backend):
    name = NAME

    def __init__(self, device: str, cpu_target: str | None = None):
        """`cpu_target`: what CPU code is compiled for (target.py: native, auto, portable, a level);
        None: the default (target.py). CUDA graphs have CPU code too (the host wrapper)."""
        from qic.backends.inductor.load import check_torch
        check_torch()
        if device not in DEVICES:
            raise ConfigError(f"the inductor back end targets cpu or cuda, not {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device",
                              "build on a machine with a GPU, or use --device cpu")
        super().__init__(device)
        self.cpu_target = resolve_cpu_target(cpu_target)
        lacks = target_mismatch(host_target("cpu", self.cpu_target), "cpu")
        # Inductor's ISA check (pinned_vector_isa's bool(isa)) runs a probe here: on a machine without the level
        # it would quietly give scalar kernels, so a level above this machine's is refused, not cross-built.
        if lacks:
            raise ConfigError(f"cpu_target {self.cpu_target} cannot be built on this machine: {lacks}",
                              "build on a machine of that level, or choose a lower cpu_target")

    @classmethod
    def from_spec(cls, spec) -> InductorBackend:
        return cls(spec.device, cpu_target=spec.cpu_target)

    def identity(self) -> dict:
        """Everything that decides whether an artifact is right and can run here. Inductor's own config
        defaults are fixed by torch's version and git hash; what changes them is our graph_configs and the
        TORCHINDUCTOR_* and AOT_INDUCTOR_* variables (read at import), so those are recorded instead of importing the
        compiler (6 s) on every build, including no-op ones."""
        ident = {"backend": self.name, "torch": torch.__version__, "torch_git": torch.version.git_version,
                 "device": self.device, "configs": graph_configs(self.device), "env": _compiler_env(),
                 "input_checks": hashlib.sha256(INPUT_CHECKS_STUB.encode()).hexdigest()[:16],
                 "passes": {"unfuse_cpu_bias_addmm": passes_digest()} if takes_qic_passes(self.device) else {},
                 "cxx": cxx_version(), "target": host_target(self.device, self.cpu_target)}
        if self.device == "cuda":
            ident["cuda"] = torch.version.cuda
        return ident

    def trace(self, gdef, tensors: dict) -> Traced:
        return export_graph(gdef, tensors)

    def compile(self, traced: Traced, out_dir: Path) -> CompiledGraph:
        from torch._inductor import aoti_compile_and_package

        # The program as a compile worker gets it (compile_task): saved without its unread module state, which
        # also leaves out the example inputs AOTInductor reads (the weights: save would write them too).
        program = saveable(traced.payload)
        program.example_inputs = traced.payload.example_inputs
        baked = baked_tensors(program)
        if baked:  # a weight-dependent constant would silently pin one checkpoint's values
            raise RuntimeError(f"the exported graph holds tensors of its own {baked[:3]}; every tensor must be an "
                               "input (the graph's weights are bound at load)")
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "graph.pt2"
        with warnings.catch_warnings():
            # Inductor deep-copies the graph, constructing torch's own deprecated pytree LeafSpec: a
            # notice to torch's developers that tells a qic user nothing. Only that one is silenced.
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            with pinned_vector_isa(self.cpu_target), without_input_checks():
                aoti_compile_and_package(program, package_path=str(path),
                                         inductor_configs=compile_options(self.device, cpu_target=self.cpu_target,
                                                                          collectives=has_collectives(program)))
        return CompiledGraph(file=path.name)

    def compile_task(self, traced: Traced, out_dir: Path, scratch: Path):
        """The program saved as the export back end saves it (compile() drops the same unread module state), for a
        worker to load and compile, with the shapes, strides, dtypes and devices of its example inputs (a saved
        program keeps none, and a dynamic text dimension reads back symbolic). A graph with collectives is compiled
        here, where its fake process group was made."""
        program = traced.payload
        if has_collectives(program):
            return None
        examples = [(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."), str(t.device))
                    for t in torch.utils._pytree.tree_leaves(program.example_inputs)]
        path = scratch / "program.pt2"
        torch.export.save(saveable(program), str(path))
        return compile_saved, (self.device, self.cpu_target, str(path), examples, str(out_dir))


def compile_saved(device: str, cpu_target: str, program_file: str, examples: list, out_dir: str) -> CompiledGraph:
    """A compile worker's call (InductorBackend.compile_task): the saved program compiled as compile() would, its
    example inputs (which AOTInductor reads) stood in by tensors of the build's examples' shapes, strides, dtypes
    and devices, allocated and never written: compiling reads their metadata, as it never reads the build's own
    memory-mapped weights. A failure comes back as a RuntimeError naming it: inductor's errors hold frames, which
    do not pickle across processes."""
    try:
        program = torch.export.load(program_file)
        leaves = [torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=where)
                  for shape, stride, dtype, where in examples]
        program.example_inputs = torch.utils._pytree.tree_unflatten(leaves, program.call_spec.in_spec)
        return InductorBackend(device, cpu_target).compile(Traced(None, [], program), Path(out_dir))
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


def export_graph(gdef, tensors: dict) -> Traced:
    """torch.export of the module with its weights as trailing inputs; the exported graph's text and signature
    name it in the cache (the export back end saves this same program)."""
    names = list(tensors)
    args = tuple(t for _, t in gdef.inputs)
    dynamic = None
    if gdef.dynamic:
        dynamic = (tuple(gdef.dynamic.get(name) for name, _ in gdef.inputs), [None] * len(names))
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(gdef.module, names), (args, [tensors[n] for n in names]),
                                      dynamic_shapes=dynamic)
    h = hashlib.sha256(b"qic-graph-v2")
    if has_collectives(program):   # compiled with other configs: its own key
        h.update(json.dumps(COLLECTIVE_GRAPH_CONFIGS, sort_keys=True).encode())
    h.update(graph_text(program).encode())
    h.update(str(program.graph_signature).encode())
    return Traced(h, names, program)


def saveable(program):
    """The program as torch.export.save should write it: without the module state it lists but never reads (export
    lifts every parameter and buffer of the module it is given, also those the weights, its inputs, replace, and
    save would write a copy of the checkpoint into every graph), and with each constant in a storage of its own
    (RoPE's text and image tables are two views of one; save writes a storage once, from one tensor that must
    cover the others, and warns when none does). The program is changed in place: it is compiled once."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind
    graph = program.graph_module.graph
    unread = {n.name for n in graph.nodes if n.op == "placeholder" and not n.users}
    dropped = [s for s in program.graph_signature.input_specs
               if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.arg.name in unread]
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in {s.arg.name for s in dropped}]:
        graph.erase_node(node)
    program.graph_module.recompile()
    targets = {s.target for s in dropped}
    signature = ExportGraphSignature([s for s in program.graph_signature.input_specs if s not in dropped],
                                     program.graph_signature.output_specs)
    constants = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in program.constants.items()}
    return torch.export.ExportedProgram(
        root=program.graph_module, graph=graph, graph_signature=signature,
        state_dict={k: v for k, v in program.state_dict.items() if k not in targets},
        range_constraints=program.range_constraints, module_call_graph=program.module_call_graph,
        constants=constants, verifiers=program.verifiers)


def baked_tensors(program) -> list[str]:
    """The tensors an exported graph reads that are not its inputs: parameters and buffers (module state, where a
    checkpoint's values would live) and lifted constants of more than one element, each with a user in the graph.
    A 0-dim lifted constant is a number the code wrapped (RoPE's theta), which inductor writes into the kernels
    as a literal. The weights are inputs (WeightsAsInputs replaces the module's own, which export still lists,
    unread), so a graph built right reads none of these, and a compiled package's constants can only come from
    them: checking here, before compiling, is the check on the package without loading it (reading a package's
    constants took loading it in a child process, about 2 s a graph, since torch's loader never unmaps a .so)."""
    sig = program.graph_signature
    held = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
            **{n: fqn for n, fqn in sig.inputs_to_lifted_tensor_constants.items()
               if program.constants[fqn].dim() > 0}}
    return sorted(held[n.name] for n in program.graph.nodes if n.op == "placeholder" and n.name in held and n.users)


def _compiler_env() -> dict:
    # The cache location does not change what is compiled.
    return {k: v for k, v in sorted(os.environ.items())
            if (k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")
            or k.startswith("AOT_INDUCTOR_") or k in ("ATEN_CPU_CAPABILITY", "CXX")}


@functools.lru_cache(maxsize=4)
def cxx_version(cxx: str | None = None) -> str:
    """The C++ compiler inductor uses for CPU code (cpp.cxx: $CXX, else g++), as `--version` names it."""
    cxx = cxx or os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{path}: no version"
    return f"{path}: {out.splitlines()[0] if out else 'no version'}"


BACKEND = InductorBackend


class WeightsAsInputs(torch.nn.Module):
    """forward(args, weights): the module run with `weights` (in `names` order) as its tensors."""

    def __init__(self, module: torch.nn.Module, names: list[str]):
        super().__init__()
        self.module, self.names = module, names

    def forward(self, args, weights):
        return torch.func.functional_call(self.module, dict(zip(self.names, weights)), args)


def graph_text(program) -> str:
    """The whole exported graph as text: every nested graph (scan bodies are submodules, absent from
    the top-level code) with each value's dtype and shape, so weight shapes (TP=1 vs TP=2) count.
    Source-location comments are dropped: they name paths that differ between checkouts."""
    text = program.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
