"""Run a NEFF on a NeuronCore through libnrt (the Neuron runtime's C API), called with ctypes.

Run-time module: imports torch and the standard library only (no torch_xla, torch_neuronx, qic.models
or qic.builder). Weights are copied to device tensors once, at load; each call writes the graph inputs,
executes, and reads the outputs back into CPU tensors.

Calls used, with the declarations in aws-neuron-sdk src/libnrt/include/nrt/{nrt.h,nrt_experimental.h,
nrt_status.h} ([C] confirmed there, [I] inferred, [U] unconfirmed until run on a Trainium host):
- [C] nrt_init(framework, fw_version, fal_version), NRT_FRAMEWORK_TYPE_NO_FW = 1; nrt_close().
- [C] nrt_load(neff, size, vnc, vnc_count, &model) and nrt_load_collectives(neff, size, vnc, vnc_count,
  ctx_device_id, ctx_device_count, &model); vnc_count is "DEPRECATED: always use -1". Every rank loads
  the same NEFF with its rank and the world size (nkipy spike/src/model.cpp does the same).
- [C] nrt_get_model_tensor_info(model, &info) / nrt_free_model_tensor_info(info); the info array is
  {uint64 count; nrt_tensor_info_t[count]} with {char name[256]; usage (0 input, 1 output); size_t size;
  nrt_dtype_t dtype; uint32_t *shape; uint32_t ndim}.
- [C] nrt_tensor_allocate(placement=DEVICE 0, vnc, size, name, &t), nrt_tensor_write/read(t, buf, offset,
  size), nrt_tensor_free(&t); nrt_allocate_tensor_set(&s), nrt_add_tensor_to_tensor_set(s, name, t),
  nrt_destroy_tensor_set(&s); nrt_execute(model, inputs, outputs); nrt_unload(model). Status 0 = success.
- [C] NEURON_RT_VISIBLE_CORES (a core or a range) picks the cores a process reserves and must be set
  before nrt_init; NEURON_LOGICAL_NC_CONFIG must equal the --lnc the NEFF was compiled with; nkipy's
  Qwen-Image sets NEURON_RT_VISIBLE_CORES=<rank> and NEURON_RT_ROOT_COMM_ID=localhost:61455 per rank.
  [I] core indices count logical cores (a trn2.48xlarge presents 64 at LNC=2, 128 at LNC=1), so rank r
  uses core r (plus QIC_NEURON_FIRST_CORE) at either LNC, and vnc 0 inside the process.

Assumptions about the NEFF (the lowering must make them true; checked at load, BundleError if not):
- [C] torch-neuronx's HLO carries frontend_attributes neff_input_names="input<i>" on entry parameter i
  and neff_output_names="output0,output1,..." on the root tuple; nkipy's HLO builder uses the same
  attributes. qic's lowering sets them, so the NEFF's tensors are named input<i> / output<j>.
- HLO parameter order = the graph's inputs, then its weights in the recorded weight order; outputs in
  the graph's output order. Tensors are matched by the index in their name, never by the order nrt
  lists them in ([I] nrt lists them from a std::map, so input10 would come before input2).
- [U] that neuronx-cc keeps every parameter (none pruned): a gap in the input indices is refused.
- [U] dtype codes follow the current nrt.h (FLOAT32 = 0xA, BFLOAT16 = 6, ...); older headers numbered
  them differently, so every output's byte size is checked against its shape and dtype.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from qic.errors import BundleError

DEFAULT_LIBNRT = "/opt/aws/neuron/lib/libnrt.so.1"
DEFAULT_COMM_ID = "localhost:61455"
FRAMEWORK_NO_FW = 1
PLACEMENT_DEVICE = 0
USAGE_INPUT, USAGE_OUTPUT = 0, 1
DTYPES = {0xA: torch.float32, 0x6: torch.bfloat16, 0x7: torch.float16, 0xC: torch.int64, 0x8: torch.int32,
          0x4: torch.int16, 0x2: torch.int8, 0x3: torch.uint8}
STATUS = {1: "NRT_FAILURE", 2: "NRT_INVALID", 3: "NRT_INVALID_HANDLE", 4: "NRT_RESOURCE", 5: "NRT_TIMEOUT",
          6: "NRT_HW_ERROR", 7: "NRT_QUEUE_FULL", 9: "NRT_LOAD_NOT_ENOUGH_NC",
          10: "NRT_UNSUPPORTED_NEFF_VERSION", 13: "NRT_UNINITIALIZED", 14: "NRT_CLOSED",
          1002: "NRT_EXEC_BAD_INPUT", 1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR", 1004: "NRT_EXEC_COMPLETED_WITH_ERR",
          1005: "NRT_EXEC_NC_BUSY"}
_INPUT, _OUTPUT = re.compile(r"input(\d+)"), re.compile(r"output(\d+)")


class TensorInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("usage", ctypes.c_int), ("size", ctypes.c_size_t),
                ("dtype", ctypes.c_int), ("shape", ctypes.POINTER(ctypes.c_uint32)), ("ndim", ctypes.c_uint32)]


def find_library() -> tuple[str | None, str]:
    """(path of libnrt, "") or (None, one line saying why not). QIC_LIBNRT wins when set."""
    env = os.environ.get("QIC_LIBNRT")
    if env:
        return (env, "") if Path(env).is_file() else (None, f"QIC_LIBNRT={env} does not exist")
    found = ctypes.util.find_library("nrt")
    if found:
        return found, ""
    if Path(DEFAULT_LIBNRT).is_file():
        return DEFAULT_LIBNRT, ""
    return None, (f"libnrt (the Neuron runtime) not found: no QIC_LIBNRT, no libnrt on the linker path, "
                  f"no {DEFAULT_LIBNRT}")


class _Runtime:
    """The process's libnrt: initialised once (after the core environment is set), closed at exit."""

    def __init__(self):
        self.lib = None
        self.models: set = set()
        self.lock = threading.Lock()

    def start(self, rank: int, world: int, lnc: int):
        with self.lock:
            if self.lib is not None:
                if self.rank != rank or self.world != world:
                    raise BundleError(f"this process already runs rank {self.rank} of {self.world}; "
                                      f"cannot also load rank {rank} of {world}", "run one rank per process")
                return self.lib
            path, why = find_library()
            if path is None:
                raise BundleError(why, "run on a Trainium host with aws-neuronx-runtime-lib, or set QIC_LIBNRT")
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise BundleError(f"libnrt at {path} cannot be loaded: {e}") from None
            _declare(lib)
            first = int(os.environ.get("QIC_NEURON_FIRST_CORE", "0"))
            os.environ["NEURON_RT_VISIBLE_CORES"] = str(first + rank)
            os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(lnc)
            if world > 1:
                os.environ.setdefault("NEURON_RT_ROOT_COMM_ID", DEFAULT_COMM_ID)
            _check(lib.nrt_init(FRAMEWORK_NO_FW, b"", b""), "nrt_init")
            self.lib, self.rank, self.world = lib, rank, world
            atexit.register(self.close)
            return lib

    def close(self):
        with self.lock:
            for model in list(self.models):
                model.close()
            if self.lib is not None:
                self.lib.nrt_close()
                self.lib = None


_RUNTIME = _Runtime()


def load(path: str | Path, weights: Sequence[torch.Tensor], device: str = "neuron", rank: int = 0,
         world: int = 1, lnc: int = 1, outputs: Sequence[dict] | None = None) -> Callable:
    """A callable over the graph's inputs (a list of CPU tensors) returning its outputs as CPU tensors.

    `weights` are this rank's tensors in the graph's weight order (HLO parameters after the inputs);
    `outputs`, when given ({"shape", "dtype"} per output), is checked against the NEFF instead of
    trusting nrt's dtype codes.
    """
    if device != "neuron":
        raise BundleError(f"a NEFF runs on device 'neuron', not {device!r}")
    neff = Path(path).read_bytes()
    lib = _RUNTIME.start(rank, world, lnc)
    model = _Model(lib, neff, Path(path), list(weights), rank, world, outputs)
    _RUNTIME.models.add(model)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return model.run(inputs)

    run.close = model.close
    run.model = model
    return run


def shutdown() -> None:
    """Unload every model and close the runtime (also done at interpreter exit)."""
    _RUNTIME.close()


class _Model:
    def __init__(self, lib, neff: bytes, path: Path, weights: list[torch.Tensor], rank: int, world: int,
                 outputs: Sequence[dict] | None):
        self.lib, self.path, self.handle = lib, path, ctypes.c_void_p()
        self.tensors: list[ctypes.c_void_p] = []
        self.sets: list[ctypes.c_void_p] = []
        if world > 1:
            _check(lib.nrt_load_collectives(neff, len(neff), 0, -1, rank, world, ctypes.byref(self.handle)),
                   "nrt_load_collectives", path)
        else:
            _check(lib.nrt_load(neff, len(neff), 0, -1, ctypes.byref(self.handle)), "nrt_load", path)
        try:
            ins, outs = self._tensor_info()
            n_inputs = len(ins) - len(weights)
            if n_inputs < 0:
                raise BundleError(f"{path}: NEFF takes {len(ins)} inputs, fewer than the {len(weights)} weights")
            in_tensors = [self._allocate(name, size) for name, size, _, _ in ins]
            for (name, size, _, _), t, w in zip(ins[n_inputs:], in_tensors[n_inputs:], weights):
                self._write(t, w, name, size)                     # copied once, reused by every call
            self.inputs = [(t, size) for t, (_, size, _, _) in zip(in_tensors[:n_inputs], ins)]
            self.outputs = [self._allocate(name, size) for name, size, _, _ in outs]
            self.out_specs = _output_specs(path, outs, outputs)
            self.in_set = self._set([name for name, *_ in ins], in_tensors)
            self.out_set = self._set([name for name, *_ in outs], self.outputs)
        except BaseException:
            self.close()
            raise

    def _tensor_info(self):
        info = ctypes.c_void_p()
        _check(self.lib.nrt_get_model_tensor_info(self.handle, ctypes.byref(info)), "nrt_get_model_tensor_info",
               self.path)
        try:
            count = ctypes.c_uint64.from_address(info.value).value
            array = (TensorInfo * count).from_address(info.value + ctypes.sizeof(ctypes.c_uint64))
            listed = [(t.name.decode(), t.usage, t.size, t.dtype, [t.shape[d] for d in range(t.ndim)])
                      for t in array]
        finally:
            self.lib.nrt_free_model_tensor_info(info)
        return (_by_index(self.path, [t for t in listed if t[1] == USAGE_INPUT], _INPUT),
                _by_index(self.path, [t for t in listed if t[1] == USAGE_OUTPUT], _OUTPUT))

    def _allocate(self, name: str, size: int) -> ctypes.c_void_p:
        t = ctypes.c_void_p()
        _check(self.lib.nrt_tensor_allocate(PLACEMENT_DEVICE, 0, size, name.encode(), ctypes.byref(t)),
               f"nrt_tensor_allocate({name})", self.path)
        self.tensors.append(t)
        return t

    def _set(self, names: list[str], tensors: list) -> ctypes.c_void_p:
        s = ctypes.c_void_p()
        _check(self.lib.nrt_allocate_tensor_set(ctypes.byref(s)), "nrt_allocate_tensor_set", self.path)
        self.sets.append(s)
        for name, t in zip(names, tensors):
            _check(self.lib.nrt_add_tensor_to_tensor_set(s, name.encode(), t), "nrt_add_tensor_to_tensor_set",
                   self.path)
        return s

    def _write(self, t, tensor: torch.Tensor, name: str, size: int) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != size:
            raise BundleError(f"{self.path}: tensor {name} has {nbytes} bytes, the NEFF expects {size}",
                              "the bundle's weights or inputs do not match the compiled graph; rebuild it")
        _check(self.lib.nrt_tensor_write(t, ctypes.c_void_p(tensor.data_ptr()), 0, size),
               f"nrt_tensor_write({name})", self.path)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.handle is None:
            raise BundleError(f"{self.path}: model was unloaded")
        if len(inputs) != len(self.inputs):
            raise BundleError(f"{self.path}: graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        for i, ((t, size), x) in enumerate(zip(self.inputs, inputs)):
            self._write(t, x, f"input{i}", size)
        _check(self.lib.nrt_execute(self.handle, self.in_set, self.out_set), "nrt_execute", self.path)
        results = []
        for j, (t, (shape, dtype)) in enumerate(zip(self.outputs, self.out_specs)):
            out = torch.empty(shape, dtype=dtype)
            _check(self.lib.nrt_tensor_read(t, ctypes.c_void_p(out.data_ptr()), 0, out.numel() * out.element_size()),
                   f"nrt_tensor_read(output{j})", self.path)
            results.append(out)
        return results

    def close(self) -> None:
        """Free tensors and sets, then unload the model (idempotent)."""
        for s in self.sets:
            self.lib.nrt_destroy_tensor_set(ctypes.byref(s))
        for t in self.tensors:
            self.lib.nrt_tensor_free(ctypes.byref(t))
        self.sets, self.tensors = [], []
        if self.handle is not None and self.handle.value:
            self.lib.nrt_unload(self.handle)
        self.handle = None
        _RUNTIME.models.discard(self)


def _by_index(path: Path, tensors: list, pattern: re.Pattern) -> list:
    """(name, size, dtype, shape) sorted by the index in the name; names must be input<i>/output<j>, 0..n-1."""
    indexed = []
    for name, _, size, dtype, shape in tensors:
        m = pattern.fullmatch(name)
        if not m:
            raise BundleError(f"{path}: NEFF tensor {name!r} is not named {pattern.pattern}",
                              "lower with neff_input_names/neff_output_names frontend attributes")
        indexed.append((int(m.group(1)), (name, size, dtype, shape)))
    indexed.sort()
    if [i for i, _ in indexed] != list(range(len(indexed))):
        raise BundleError(f"{path}: NEFF tensor indices {[i for i, _ in indexed]} are not 0..{len(indexed) - 1} "
                          "(did the compiler drop an unused parameter?)")
    return [t for _, t in indexed]


def _output_specs(path: Path, outs: list, given: Sequence[dict] | None) -> list[tuple[list[int], torch.dtype]]:
    specs = []
    if given is not None and len(given) != len(outs):
        raise BundleError(f"{path}: NEFF has {len(outs)} outputs, the bundle describes {len(given)}")
    for j, (name, size, code, shape) in enumerate(outs):
        if given is not None:
            shape, dtype = list(given[j]["shape"]), getattr(torch, given[j]["dtype"])
        elif code in DTYPES:
            dtype = DTYPES[code]
        else:
            raise BundleError(f"{path}: output {name} has nrt dtype code {code}, which qic does not know")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != size:
            raise BundleError(f"{path}: output {name} is {size} bytes, but shape {shape} of {dtype} is "
                              f"{numel * dtype.itemsize}")
        specs.append((shape, dtype))
    return specs


def _check(status: int, call: str, path: Path | None = None) -> None:
    if status != 0:
        where = f"{path}: " if path else ""
        raise BundleError(f"{where}libnrt {call} failed with status {status} ({STATUS.get(status, 'unknown')})")


def _declare(lib) -> None:
    vp, sz, i32, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_uint32
    pvp = ctypes.POINTER(vp)
    sigs = {
        "nrt_init": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int),
        "nrt_close": ([], None),
        "nrt_load": ([vp, sz, i32, i32, pvp], ctypes.c_int),
        "nrt_load_collectives": ([vp, sz, i32, i32, u32, u32, pvp], ctypes.c_int),
        "nrt_unload": ([vp], ctypes.c_int),
        "nrt_get_model_tensor_info": ([vp, pvp], ctypes.c_int),
        "nrt_free_model_tensor_info": ([vp], ctypes.c_int),
        "nrt_tensor_allocate": ([ctypes.c_int, ctypes.c_int, sz, ctypes.c_char_p, pvp], ctypes.c_int),
        "nrt_tensor_free": ([pvp], None),
        "nrt_tensor_write": ([vp, vp, sz, sz], ctypes.c_int),
        "nrt_tensor_read": ([vp, vp, sz, sz], ctypes.c_int),
        "nrt_allocate_tensor_set": ([pvp], ctypes.c_int),
        "nrt_destroy_tensor_set": ([pvp], None),
        "nrt_add_tensor_to_tensor_set": ([vp, ctypes.c_char_p, vp], ctypes.c_int),
        "nrt_execute": ([vp, vp, vp], ctypes.c_int),
    }
    for name, (args, res) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise BundleError(f"libnrt lacks {name}; it is older than the nrt.h this loader follows") from None
        fn.argtypes, fn.restype = args, res
