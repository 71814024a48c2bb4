"""Depth-independent forms of layer-list models: one device-side loop over stacked layers.

Shared by every family (it stays in qic/models/, not in a family folder): any transformer whose layers are a
list of identical modules loops the same way. Qwen-Image's denoiser and text encoder subclass their unrolled
models with it (qic/models/qwen_image/mmdit.py and text_encoder.py); a component names its layer list's prefix
in its definition (qic.family.Component.blocks), which the shard stage stacks by.

`QwenMMDiT` and `QwenTextEncoder` (for instance) hold one module per layer, so an exported graph holds L copies of the
layer and compile time and artifact size grow with depth (60 blocks at 1024 px also exceed the 2 GB
protobuf limit of an XLA/Neuron graph). Here the L layers' tensors are stacked into one tensor of shape
[L, ...] per layer-local name, and the layers run as `torch._higher_order_ops.scan` over those stacks:
the exported graph holds one layer body, whatever L.

Tensor names (the shard stage's contract). A per-layer tensor `<prefix>.<i>.<rest>` (i = 0..L-1) becomes
row i of the stacked tensor `<prefix>.stacked.<rest>`:

    transformer_blocks.7.attn.to_q.weight           -> transformer_blocks.stacked.attn.to_q.weight [L, ...]
    model.layers.3.mlp.down_proj.weight              -> model.layers.stacked.mlp.down_proj.weight   [L, ...]

Every other tensor keeps its name. `stacked_name(name, prefix)` maps one name (the shard stage streams tensors:
it writes each stacked tensor as the concatenation of its L slices in layer order, slice i at byte
offset i * slice_bytes); `stack_block_weights` / `unstack_block_weights` convert whole state dicts.
Under tensor parallelism the stacked dim 0 is the layer index, so a per-layer split dim d becomes d + 1
(or: slice each per-layer tensor with the per-layer plan, then stack the slices).

How the loop body runs. `StackedLayers` holds the stacks (under `stacked.`) and a template layer (under
`template.`) built by the unrolled model's own code but holding no tensors: its parameters are None, so
it adds nothing to state_dict, parameters() or a WeightsAsInputs input list. The scan body calls the
template with one layer's slices through `torch.func.functional_call`, so the layer arithmetic is the
unrolled model's, line for line. Since the template's modules are registered submodules, a TP plan that
sets `RowLinear.reduce` on every RowLinear of the model finds the template's (e.g.
`transformer_blocks.template.attn.to_out.0`) and the reduce runs inside the body.

What scan takes (torch 2.13), and the form used:
- carry: the running activations, (img, txt) for the denoiser, (x,) for the text encoder;
- xs: the stacked tensors, sliced along dim 0 per iteration;
- loop invariants (temb, attention mask, RoPE tables): passed as the operator's `additional_inputs`,
  tensors only; a None invariant (the denoiser's mask-free fast path) stays a Python constant of the
  body, so that body is traced without a mask and the graph holds none;
- per-iteration outputs: one 0-dim zero per layer, so no [L, ...] activation stack is materialised.
  No output at all (an empty tuple) runs eagerly and exports, but AOTInductor then fails with
  "<built-in function getitem> is not an OpOverload".
Eager calls and non-strict torch.export (what qic.build.compile does) call the operator `scan_op`
directly: the public `scan()` wrapper first traces the body with dynamo on every new input signature
(seconds each here: this module's eager parity tests ran 3.5x longer that way). Under dynamo (torch.compile,
strict export) the operator is refused unless called through the wrapper, so there the wrapper is used,
with the invariants closed over (dynamo lifts them into additional_inputs itself).
AOTInductor (CPU) lowers the scan to a C++ while loop around one compiled body that reads layer i's
weights as strided views of the stacks (offset i * slice size): no per-layer copies.

A looped model (Qwen-Image's `LoopedMMDiT` / `LoopedTextEncoder`) subclasses the unrolled one and replaces
its layer list by one `StackedLayers`; iterating a StackedLayers yields itself once, as a single callable
that applies all L layers, so the unrolled model's own forward (`for block in self.transformer_blocks: ...`)
runs the scan unchanged: embedding, mask and output code exist once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch._higher_order_ops.scan import scan, scan_op

from qic.errors import CheckpointError

STACKED = "stacked"


# ---------------------------------------------------------------------------------------------- names

def _prefixes(prefix: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(prefix, str):
        prefix = (prefix,)
    return tuple(p.rstrip(".") for p in prefix)


def stacked_name(name: str, prefix: str | Iterable[str]) -> tuple[str, int] | None:
    """(stacked tensor name, layer index) for a per-layer tensor name, or None for any other tensor.

    `transformer_blocks.12.img_mod.1.weight` -> (`transformer_blocks.stacked.img_mod.1.weight`, 12).
    prefix: the layer list's module name(s) (a component's `blocks`: qic.family.Component).
    """
    for p in _prefixes(prefix):
        if name.startswith(p + "."):
            index, dot, rest = name[len(p) + 1:].partition(".")
            if dot and rest and index.isdigit() and index.isascii():
                return f"{p}.{STACKED}.{rest}", int(index)
    return None


def layer_name(stacked: str, index: int) -> str:
    """Inverse of stacked_name: (`model.layers.stacked.mlp.up_proj.weight`, 3) ->
    `model.layers.3.mlp.up_proj.weight`."""
    head, sep, rest = stacked.partition(f".{STACKED}.")
    if not sep:
        raise ValueError(f"{stacked!r} is not a stacked tensor name")
    return f"{head}.{index}.{rest}"


def stack_block_weights(state_dict: Mapping[str, torch.Tensor], prefix: str | Iterable[str],
                        num_layers: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors `<prefix>.<i>.<rest>` -> one `<prefix>.stacked.<rest>` of shape [num_layers, ...]
    (row i = layer i); other tensors pass through. Refuses missing or extra layers and slices that
    disagree in shape or dtype, naming the tensor."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state_dict.items():
        hit = stacked_name(name, prefix)
        if hit is None:
            out[name] = t
            continue
        sname, i = hit
        if i >= num_layers:
            raise CheckpointError(f"tensor {name} is layer {i}, but the model has {num_layers} layers")
        groups.setdefault(sname, {})[i] = t
    for sname, layers in groups.items():
        missing = [i for i in range(num_layers) if i not in layers]
        if missing:
            raise CheckpointError(f"missing tensor {layer_name(sname, missing[0])}"
                                  + (f" (+{len(missing) - 1} more layers)" if len(missing) > 1 else ""))
        first = layers[0]
        for i in range(1, num_layers):
            t = layers[i]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise CheckpointError(f"tensor {layer_name(sname, i)} is {t.dtype} {tuple(t.shape)}, layer 0's "
                                      f"is {first.dtype} {tuple(first.shape)}: layers cannot be stacked")
        out[sname] = torch.stack([layers[i] for i in range(num_layers)])
    return out


def unstack_block_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of stack_block_weights: each `<prefix>.stacked.<rest>` [L, ...] -> L tensors
    `<prefix>.<i>.<rest>` (views of the stack); other tensors pass through."""
    out = {}
    for name, t in state_dict.items():
        if f".{STACKED}." in name:
            for i in range(t.shape[0]):
                out[layer_name(name, i)] = t[i]
        else:
            out[name] = t
    return out


# ---------------------------------------------------------------------------------------------- loop

# A back end whose tensors cannot run torch's scan operator (XLA lazy tensors have no as_strided, which
# the operator's slicing needs) supplies its own device-side loop here; the layer arithmetic stays the
# model's. Signature: loop(layer, carry, xs, invariants) -> (final carry list, per-layer output stacks), where
# layer(carry, xs slices, invariants) -> (next carry list, per-layer output list): each per-layer output
# comes back stacked [L, ...] in layer order (what a prefill's per-layer K/V are); an empty list, none.
_LOOP = contextvars.ContextVar("qic_layer_loop", default=None)


def custom_loop() -> Callable | None:
    """The loop layer_loop installed, or None (torch's scan then). Never under dynamo, which cannot trace a
    ContextVar."""
    return None if torch.compiler.is_dynamo_compiling() else _LOOP.get()


@contextlib.contextmanager
def layer_loop(loop: Callable):
    """Run every StackedLayers inside this block with `loop` instead of torch's scan operator."""
    token = _LOOP.set(loop)
    try:
        yield
    finally:
        _LOOP.reset(token)


def _param_tree(template: nn.Module, num_layers: int) -> nn.Module:
    """A module tree mirroring the template's, each parameter replaced by [num_layers, *shape].

    Initial values: the template's own initialisation repeated per layer (a real model loads its weights
    over them).
    """
    root = nn.Module()
    for name, p in template.named_parameters():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        stacked = p.detach().unsqueeze(0).expand(num_layers, *p.shape).clone()
        node.register_parameter(leaf, nn.Parameter(stacked, requires_grad=p.requires_grad))
    return root


class StackedLayers(nn.Module):
    """L identical layers as one module: stacked tensors under `stacked.`, a tensor-free template under
    `template.`, run by one scan.

    forward(*carry, *invariants): the first `num_carry` arguments are threaded through the layers (each
    layer returns the next carry: a tensor when num_carry is 1, else a tuple); the rest are passed
    unchanged to every layer (tensors or None). Returns the carry after layer L-1.
    """

    def __init__(self, template: nn.Module, num_layers: int, num_carry: int):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"StackedLayers needs at least one layer, got {num_layers}")
        if any(True for _ in template.buffers()):
            raise ValueError("StackedLayers takes templates with parameters only (buffers would need stacking too)")
        self.num_layers, self.num_carry = num_layers, num_carry
        self.names: list[str] = []
        self.stacked = nn.Module()
        self.template = template
        self.adopt_new_parameters()

    def adopt_new_parameters(self) -> None:
        """Stack the template's parameters (at construction all of them; later, those added to it since: a LoRA
        slot, qic.models.lora_slots), each repeated over the layers, and take them out of the template: it keeps
        its code and RowLinear hooks, no tensors."""
        new = [n for n, _ in self.template.named_parameters()]
        tree = _param_tree(self.template, self.num_layers)
        for name in new:
            *path, leaf = name.split(".")
            node, src = self.stacked, tree
            for part in path:
                src = src._modules[part]
                if part not in node._modules:
                    node.add_module(part, nn.Module())
                node = node._modules[part]
            node.register_parameter(leaf, src._parameters[leaf])
        self.names += new
        for m in self.template.modules():
            for k in m._parameters:
                m._parameters[k] = None

    def __iter__(self):
        # The unrolled models loop `for layer in layers: ...`; one item that applies every layer lets that
        # same forward code run the scan.
        return iter((self,))

    def __getitem__(self, index: slice):
        """layers[a:b], like a ModuleList's slice: iterates as one callable running layers a..b-1 (a view of
        rows a..b-1 of every stack, no copy), or as nothing for an empty range."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"StackedLayers takes a contiguous slice of layers, got {index!r}")
        start, stop, _ = index.indices(self.num_layers)
        if stop <= start:
            return ()
        return (self,) if (start, stop) == (0, self.num_layers) else (_LayerRange(self, start, stop),)

    def stacked_tensors(self) -> dict[str, torch.Tensor]:
        """Layer-local name -> current [L, ...] tensor (follows functional_call's substitutions)."""
        # Not get_parameter: under functional_call the attributes are plain tensors, not Parameters.
        out = {}
        for name in self.names:
            path, _, leaf = name.rpartition(".")
            out[name] = getattr(self.stacked.get_submodule(path), leaf)
        return out

    def forward(self, *args, layers: tuple[int, int] | None = None):
        """layers: (start, stop) to run only those (what a slice calls); None runs all."""
        carry, invariants = tuple(args[:self.num_carry]), args[self.num_carry:]
        xs = self.stacked_tensors()
        if layers is not None:
            xs = {k: v[layers[0]:layers[1]] for k, v in xs.items()}
        names, n_carry, template = list(xs), self.num_carry, self.template

        def layer(carry, weights, extra):
            out = torch.func.functional_call(template, dict(zip(names, weights)), (*carry, *extra))
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            # A 0-dim per-layer output: AOTInductor (torch 2.13) fails on a scan without one
            # ("<built-in function getitem> is not an OpOverload"); it costs an [L] tensor.
            return out, out[0].new_zeros(())

        custom = custom_loop()
        if custom is not None:   # no per-layer outputs: a custom loop needs no dummy one
            final, _ = custom(lambda c, w, e: (layer(c, w, e)[0], []), list(carry), list(xs.values()), invariants)
        elif torch.compiler.is_dynamo_compiling():
            # Under dynamo (torch.compile, strict export) only the public wrapper is captured; it lifts
            # the closed-over invariants into additional_inputs itself.
            final, _ = scan(lambda c, w: layer(c, w, invariants), list(carry), list(xs.values()))
        else:
            # Eager and non-strict torch.export (the build's): the operator itself, with the tensor
            # invariants as explicit additional_inputs. No dynamo pass (the wrapper would trace the
            # body with dynamo on every new input signature, seconds each).
            slots = [i for i, a in enumerate(invariants) if isinstance(a, torch.Tensor)]

            def body(*flat):
                extra = list(invariants)  # None stays a Python constant of the body
                for i, t in zip(slots, flat[n_carry + len(names):]):
                    extra[i] = t
                out, y = layer(flat[:n_carry], flat[n_carry:n_carry + len(names)], extra)
                return [*out, y]

            final = scan_op(body, list(carry), list(xs.values()), tuple(invariants[i] for i in slots))[:n_carry]
        return tuple(final) if n_carry > 1 else final[0]


class _LayerRange:
    """Layers start..stop-1 of a StackedLayers, callable like it (not a module: it owns no tensors)."""

    def __init__(self, layers: StackedLayers, start: int, stop: int):
        self.layers, self.range = layers, (start, stop)

    def __call__(self, *args):
        return self.layers(*args, layers=self.range)


def template_layer(build, config, tp_size: int, layers_of) -> nn.Module:
    """One layer exactly as the unrolled model builds it (from a 1-layer model, on the current default
    device: under `torch.device("meta")` it costs nothing, elsewhere one layer's default initialisation,
    which seeds every row of the stacks). build(config, tp_size) -> the unrolled model; layers_of(model) ->
    its layer list; `config` a dataclass with `num_layers`."""
    return layers_of(build(dataclasses.replace(config, num_layers=1), tp_size))[0]
