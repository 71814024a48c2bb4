"""Lower one graph to a serialized XLA `HloModuleProto` with torch-xla, and execute HLO on XLA:CPU.

This is the form `neuronx-cc compile --framework XLA` takes (docs/neuron.md). Runs only where torch-xla
is installed (the repo's `.venv-xla`, or a Trainium host's environment); imported lazily by the neuron
back end, never by the runtime's inductor path.

How a graph becomes HLO:
- Every input and every weight is an XLA *placeholder* (a shape and dtype, no data), so lowering needs
  no weight values: the 58 GB model lowers with nothing loaded, and no weight value can end up inside
  the HLO. Each placeholder becomes one HLO parameter; `param_order` records which parameter is which
  graph input or weight, in the proto's numbering. Data tensors that torch-xla creates itself while
  tracing (non-trivial Python scalars such as the step's `/ 1000`) become parameters too; their values
  are returned as `constants` and travel with the graph.
- Looped layers run as one XLA `While` over the stacked weights: torch-xla's scan core
  (`_scan_impl_pytree`: the body traced once on placeholders, sliced with dynamic-slice per iteration).
  Its public `scan()` wrapper also traces a backward pass with AOTAutograd, which needs every carry to
  be floating and differentiable and put the collectives in twice; inference needs the forward only.
  The loop invariants (time embedding, mask, RoPE tables) ride in the carry unchanged.
- Tensor parallelism: the model's functional collectives (`_c10d_functional.all_reduce` and
  `all_gather_into_tensor` on the world group, the same ops the inductor graphs hold) are lowered as
  HLO `all-reduce` / `all-gather` with explicit `replica_groups={{0..tp-1}}`, so one HLO serves every
  rank and the ranks differ only in weights (and, under Ulysses or CFG-parallel, in their rank inputs).
  A mesh's collectives name its axes; each lowers with that axis' replica groups over the whole world
  (all-to-all for Ulysses' exchange).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

# torch-xla reads these when it initialises: a CPU client, and collectives lowered even though this
# process has one device (otherwise xm.all_reduce is a no-op clone); no numeric token arithmetic
# threaded through the collectives (it adds a scalar parameter per all-reduce chain).
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_ALWAYS_ALLREDUCE", "1")
os.environ.setdefault("DISABLE_NUMERIC_CC_TOKEN", "1")

import torch_xla  # noqa: E402
import torch_xla.core.xla_builder as xb  # noqa: E402
from torch_xla.experimental.scan import _scan_impl_pytree  # noqa: E402

from qic.backends.neuron import hlo_proto  # noqa: E402
from qic.backends.neuron.xla_runtime import execute_ranks  # noqa: E402, F401  (the run side's; benchmarks use it here)
from qic.models.looped import layer_loop  # noqa: E402


@dataclass
class Lowered:
    proto: bytes                                   # serialized HloModuleProto, tensors named for the NEFF
    param_order: list[dict]                        # per HLO parameter: {"kind": input|weight|constant, "name"}
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # values of "constant" parameters
    outputs: int = 1

    def values(self, inputs: list[tuple[str, torch.Tensor]], weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors for the HLO's parameters, in order: graph inputs by name, weights, constants."""
        feed = dict(inputs)
        return [(feed[p["name"]] if p["kind"] == "input" else
                 self.constants[p["name"]] if p["kind"] == "constant" else weights[p["name"]]).detach().contiguous()
                for p in self.param_order]


def lower(module: torch.nn.Module, inputs: list[tuple[str, torch.Tensor]], weights: dict[str, torch.Tensor],
          tp: int = 1, groups: dict[str, list[list[int]]] | None = None) -> Lowered:
    """Trace `module(*inputs)` with `weights` substituted for its tensors (functional_call), on XLA
    placeholders of the same shapes and dtypes. Values are never read. `groups`: each collective group name
    the module's hooks carry -> its replica groups (default: the world group "0" over ranks 0..tp-1)."""
    _fresh_token()
    fake_inputs = [_placeholder(t) for _, t in inputs]
    fake_weights = {n: _placeholder(t) for n, t in weights.items()}
    with torch.no_grad(), layer_loop(while_loop), replica_groups(groups or {"0": [list(range(tp))]}):
        outs = torch.func.functional_call(module, fake_weights, tuple(fake_inputs))
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    ctx = torch_xla._XLAC.lowering.LoweringContext("qic_graph")
    ctx.build(outs)
    order: dict[int, dict] = {}
    for (name, _), t in zip(inputs, fake_inputs):
        _record(order, ctx.tensor_parameter_id(t), {"kind": "input", "name": name})
    for name, t in fake_weights.items():
        _record(order, ctx.tensor_parameter_id(t), {"kind": "weight", "name": name})
    constants = {}
    params = ctx.device_parameter_id_tensor_mapping()  # device tensors: placeholders are never read
    for pid, value in sorted(params.items()):
        if pid not in order:
            name = f"xla_constant_{pid}"
            order[pid] = {"kind": "constant", "name": name}
            constants[name] = value.cpu().clone()
    n = len(params)
    missing = [i for i in range(n) if i not in order]
    if missing:
        raise RuntimeError(f"HLO parameters {missing[:5]} map to no graph input, weight or constant")
    # Parameters renumbered: graph inputs first, then weights, then constants, each in the caller's
    # order, so a runtime binds weights once and feeds inputs by position (what the NEFF runner does).
    rank = {"input": 0, "weight": 1, "constant": 2}
    position = {name: i for i, (name, _) in enumerate(inputs)}
    position.update({name: i for i, name in enumerate(weights)})
    old = sorted(range(n), key=lambda i: (rank[order[i]["kind"]], position.get(order[i]["name"], i)))
    new_number = [0] * n
    for new, i in enumerate(old):
        new_number[i] = new
    proto = hlo_proto.name_entry_tensors(hlo_proto.reorder_parameters(ctx.hlo(), new_number))
    param_order = [order[i] for i in old]
    signature, _ = hlo_proto.entry_signature(proto)
    wide = [f"{p['kind']} {p['name']}" for p, (t, _) in zip(param_order, signature) if t == "f64"]
    if wide:   # NeuronCores have no fp64 arithmetic: the model code must not make fp64 values
        raise RuntimeError(f"lowered graph has fp64 parameters: {', '.join(wide[:3])}")
    return Lowered(proto, param_order, constants, len(outs))


def _record(order: dict, pid: int, entry: dict) -> None:
    if pid != -1:  # -1: the graph never reads it (XLA prunes it from the parameters)
        order[pid] = entry


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return xb.create_placeholder_tensor(tuple(t.shape), t.dtype)


def execute(proto: bytes, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run a serialized HloModuleProto on XLA:CPU with CPU tensors (in parameter order); CPU outputs.
    The runtime's own path (every parameter fed per call)."""
    from qic.backends.neuron import xla_runtime
    return xla_runtime.run_once(proto, params)


# --------------------------------------------------------------------------------------------- loops

def while_loop(layer, carry: list[torch.Tensor], xs: list[torch.Tensor], invariants
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """qic.models.looped's loop contract as one XLA While over the stacked weights (and whatever else is
    sliced per layer: a decode's cached K/V); per-layer outputs are the While's dynamic-update-sliced stacks."""
    slots = [i for i, a in enumerate(invariants) if isinstance(a, torch.Tensor)]
    # A bool carry comes back from the loop's placeholders as int64 (SDPA then refuses the mask): carry
    # bools as uint8 and restore the dtype inside the body.
    dtypes = [invariants[i].dtype for i in slots]
    fixed0 = [invariants[i].to(torch.uint8) if d == torch.bool else invariants[i] for i, d in zip(slots, dtypes)]

    def body(state, weights):
        current, fixed = state
        extra = list(invariants)  # None stays a Python constant of the body
        for i, t, d in zip(slots, fixed, dtypes):
            extra[i] = t.to(d)
        _fresh_token()
        out, ys = layer(current, weights, extra)
        _fresh_token()
        return (list(out), list(fixed)), tuple(ys)   # () when none: the HLO of a loop without outputs

    (final, _), stacks = _scan_impl_pytree(body, (list(carry), fixed0), list(xs))
    return list(final), list(stacks)


def _fresh_token() -> None:
    """torch-xla threads an ordering token from each all-gather to the next on the device. Across a loop
    body's boundary, or from one graph's lowering to the next, that token would carry the body's (or the
    other graph's) placeholders along as parameters: start each region with a fresh one."""
    torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)


# --------------------------------------------------------------------------------------------- collectives

_GROUPS: dict[str, list[list[int]]] | None = None
_LIB: torch.library.Library | None = None


@contextlib.contextmanager
def replica_groups(groups: dict[str, list[list[int]]]):
    """Within this block, functional collectives on XLA tensors lower to HLO collectives whose replica groups
    are their group name's: plain TP names the world group "0" (ranks 0..tp-1); a mesh names its axes
    (qic/parallel/mesh.py), each axis' groups spanning the world."""
    global _GROUPS
    _install_collectives()
    previous, _GROUPS = _GROUPS, dict(groups)
    try:
        yield
    finally:
        _GROUPS = previous


def _groups_of(group_name: str) -> list[list[int]]:
    if _GROUPS is None:
        raise RuntimeError("a collective outside qic's lowering: replica groups unknown")
    if group_name not in _GROUPS:
        raise RuntimeError(f"collective on group {group_name!r}, which the lowering's layout does not name "
                           f"({', '.join(sorted(_GROUPS))})")
    return _GROUPS[group_name]


def _all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return torch_xla._XLAC._xla_all_reduce(op, x, 1.0, _groups_of(group_name), True)


def _all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Stacks the ranks' tensors along dim 0, as `all_gather_into_tensor` does."""
    return torch_xla._XLAC._xla_all_gather(x, 0, group_size, _groups_of(group_name), False, None, None)


def _all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group_name: str) -> torch.Tensor:
    """Equal splits along dim 0 (qic's only use, Ulysses' exchange): HLO all-to-all, split and concatenated
    on dim 0, so block j goes to the group's j-th rank and the result holds the ranks' blocks in order."""
    groups = _groups_of(group_name)
    count = len(groups[0])
    if len(set(input_split_sizes)) > 1 or list(input_split_sizes) != list(output_split_sizes):
        raise RuntimeError(f"all_to_all with unequal splits {list(input_split_sizes)} cannot lower to HLO all-to-all")
    device = str(x.device)
    token = torch_xla._XLAC._get_all_reduce_token(device)
    out, token = torch_xla._XLAC._xla_all_to_all(x, token, 0, 0, count, groups, True)
    torch_xla._XLAC._set_all_reduce_token(device, token)
    return out


def _wait(x: torch.Tensor) -> torch.Tensor:
    return x  # XLA orders collectives itself; there is nothing to wait for in a traced graph


def _install_collectives() -> None:
    """Replace torch-xla's kernels for the functional collectives (which lower with replica_groups={},
    "all replicas") by ones that name the TP group explicitly."""
    global _LIB
    if _LIB is None:
        import warnings
        lib = torch.library.Library("_c10d_functional", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
            lib.impl("all_reduce", _all_reduce, "XLA")
            lib.impl("all_gather_into_tensor", _all_gather, "XLA")
            lib.impl("all_to_all_single", _all_to_all, "XLA")
            lib.impl("wait_tensor", _wait, "XLA")
        _LIB = lib
