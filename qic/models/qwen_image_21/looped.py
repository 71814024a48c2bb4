"""The looped form of Qwen-Image-2.1's denoiser: its blocks' weights stacked [L, ...], prefill and decode each one
scan over them, so a graph holds one block body whatever the depth (compile time and HLO size flat in L).

Storage and names are qic.models.looped's contract (a `StackedLayers` holds the stacks under
`transformer_blocks.stacked.<block-local name>` and a tensor-free template under `.template`, whose RowLinear
hooks the TP plan sets); convert an unrolled state dict with `stack_block_weights(sd, "transformer_blocks", L)`.
The scans are this model's own, because they carry what Qwen-Image's do not:
- prefill: carry (prefix, target), per-layer outputs the prefix's (k, v), which scan stacks into exactly the
  [L, B, heads, P, head_dim] graph outputs (no list and torch.stack);
- decode: carry (target,), sliced per layer along with the weights the prefill's k and v [L, ...]: each
  iteration reads its layer's prefix K/V as it reads its layer's weights; torch's scan emits a 0-dim zero per
  layer (AOTInductor fails on a scan without an output; see qic.models.looped).
The layer bodies are the unrolled model's (denoiser.prefill_layer / decode_layer), called on the template
through torch.func.functional_call, so the arithmetic exists once. Eager and non-strict torch.export call the
scan operator directly, dynamo (torch.compile, strict export) the public wrapper. The test is
torch.compiler.is_dynamo_compiling(): torch 2.13's is_compiling() is also true under non-strict export, where
the wrapper's dynamo pass over the body made the looped prefill's export take 42 s instead of 6 s here.
A back end's own loop (qic.models.looped.layer_loop: the neuron lowering's XLA While) runs both when installed;
its contract stacks per-layer outputs, which the prefill's K/V are.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._higher_order_ops.scan import scan, scan_op

from qic.models.looped import StackedLayers, custom_loop
from qic.models.qwen_image_21.denoiser import DenoiserConfig, QwenImage21Denoiser, decode_layer, prefill_layer


def _run(body, carry: list, xs: list, invariants: tuple) -> tuple[list, list]:
    """body(carry, xs slices, invariants) -> (next carry, per-layer outputs) over the layers: (final carry, the
    per-layer outputs stacked [L, ...]). A back end's own loop when one is installed (qic.models.looped.layer_loop:
    XLA's While), else torch's scan, which gets a 0-dim per-layer output where the body has none (AOTInductor
    fails on a scan without one)."""
    custom = custom_loop()
    if custom is not None:
        return custom(body, list(carry), list(xs), invariants)
    n_carry, n_xs = len(carry), len(xs)

    def flat_body(c, x, inv):
        out, ys = body(c, x, inv)
        return [*out, *(ys or [out[0].new_zeros(())])]

    if torch.compiler.is_dynamo_compiling():
        def combine(c, x):
            out = flat_body(c, x, invariants)
            return out[:n_carry], out[n_carry:]
        final, ys = scan(combine, carry, xs)
        return list(final), list(ys)
    out = list(scan_op(lambda *flat: flat_body(flat[:n_carry], flat[n_carry:n_carry + n_xs], flat[n_carry + n_xs:]),
                       carry, xs, tuple(invariants)))
    return out[:n_carry], out[n_carry:]


class _Layer(torch.nn.Module):
    """layer_fn(block, *args) as a module's forward, so torch.func.functional_call can give it one layer's weights
    (parameter names `block.<block-local name>`)."""

    def __init__(self, layer_fn, block):
        super().__init__()
        self.layer_fn, self.block = layer_fn, block

    def forward(self, *args):
        return self.layer_fn(self.block, *args)


class LoopedQwenImage21Denoiser(QwenImage21Denoiser):
    """QwenImage21Denoiser with its blocks stacked and run by scan: same prefill and decode, same outputs."""

    def __init__(self, config: DenoiserConfig, tp_size: int = 1):
        super().__init__(dataclasses.replace(config, num_layers=0), tp_size)
        self.config = config
        one = QwenImage21Denoiser(dataclasses.replace(config, num_layers=1), tp_size)
        self.transformer_blocks = StackedLayers(one.transformer_blocks[0], config.num_layers, num_carry=0)
        template = self.transformer_blocks.template
        # In a tuple, not registered: the template is already a submodule (where the TP plan finds its RowLinears).
        self._layers = (_Layer(prefill_layer, template), _Layer(decode_layer, template))

    def _weights(self):
        stacks = self.transformer_blocks.stacked_tensors()
        return [f"block.{name}" for name in stacks], list(stacks.values())

    def prefill_blocks(self, prefix, x, invariants):
        names, weights = self._weights()

        def body(carry, xs, inv):
            prefix, x, k, v = torch.func.functional_call(self._layers[0], dict(zip(names, xs)), (*carry, *inv))
            return [prefix, x], [k, v]

        (_, x), (k, v) = _run(body, [prefix, x], weights, invariants)
        return x, k, v

    def decode_blocks(self, x, k, v, invariants):
        names, weights = self._weights()

        def body(carry, xs, inv):
            w, (k, v) = xs[:len(names)], xs[len(names):]
            return [torch.func.functional_call(self._layers[1], dict(zip(names, w)), (carry[0], k, v, *inv))], []

        return _run(body, [x], [*weights, k, v], invariants)[0][0]
