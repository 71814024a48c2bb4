"""Depth-independent (scan-looped) denoiser and text encoder against their unrolled forms (fp32, CPU).

One AOTInductor compile in this file (the looped text encoder of 'tiny', the smallest looped graph);
the rest is eager and torch.export.
"""

from __future__ import annotations

import pytest
import torch

from qic.backends.inductor.build import WeightsAsInputs
from qic.checkpoint.presets import preset
from qic.errors import CheckpointError
from qic.models.common import RowLinear, load_weights
from qic.models.looped import (
    layer_name,
    stack_block_weights,
    stacked_name,
    unstack_block_weights,
)
from qic.models.qwen_image.graphs import denoiser_graph
from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT, rope_tables
from qic.models.qwen_image.step import DenoiseStep
from qic.models.qwen_image.text_encoder import LoopedTextEncoder, QwenTextEncoder, TextEncoderConfig
from tests.helpers import mmdit_bound, rel_l2, sensitize_, text_encoder_bound

# Looped and unrolled, eager, under dynamo or exported, are bit-identical (torch.equal): each layer runs
# the same kernels on the same shapes, and a stack's slice [i] is a contiguous view with layer i's
# bytes, so every sum runs in the same order (a BLAS choosing kernels by pointer alignment could
# break that; this test would say so). AOTInductor's output is not bit-identical to eager: it fuses
# and reorders reductions (fp32 addition is not associative), so the compiled loop is held to the
# fp32 reordering bound of the two models (tests/helpers.py, about 3e-5; measured 8e-7). TOL also
# sizes the "the check can fail" contrasts: wrong layer orders and hooks move results by more than
# 100x it.
GRIDS = {"tiny": (3, 5), "tiny-alt": (4, 2)}
TOL = max(*(mmdit_bound(n) for n in GRIDS), *(text_encoder_bound(n) for n in GRIDS))
COMPILED_TOL = TOL


def _denoiser_pair(name):
    config = MMDiTConfig.from_dict(preset(name)["transformer"])
    ref = sensitize_(QwenMMDiT(config)).eval()
    looped = LoopedMMDiT(config).eval()
    load_weights(looped, stack_block_weights(ref.state_dict(), "transformer_blocks", config.num_layers), "transformer")
    return ref, looped, config, GRIDS[name]


@pytest.fixture(scope="module", params=["tiny", "tiny-alt"])
def denoisers(request):
    return _denoiser_pair(request.param)


def _encoder_pair(name):
    config = TextEncoderConfig.from_dict(preset(name)["text_encoder"])
    ref = sensitize_(QwenTextEncoder(config)).eval()
    looped = LoopedTextEncoder(config).eval()
    load_weights(looped, stack_block_weights(ref.state_dict(), "model.layers", config.num_layers), "text_encoder")
    return ref, looped, config


@pytest.fixture(scope="module", params=["tiny", "tiny-alt"])
def encoders(request):
    return _encoder_pair(request.param)


def _mmdit_inputs(config, grid, txt_len=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, grid[0] * grid[1], config.in_channels, generator=g)
    e = torch.randn(2, txt_len, config.joint_attention_dim, generator=g)
    mask = torch.ones(2, txt_len, dtype=torch.long)
    mask[1, 4:] = 0
    return x, e, torch.tensor([0.7, 0.3]), mask, *rope_tables(config, *grid, txt_len)


def _ids(config, n=12, valid=9, seed=0):
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, valid:] = 0
    return ids, mask


# ------------------------------------------------------------------------------------------ names

def test_stacked_names():
    both = ("transformer_blocks", "model.layers")   # the denoiser's and the text encoder's layer lists
    assert stacked_name("transformer_blocks.12.attn.to_q.weight", both) == (
        "transformer_blocks.stacked.attn.to_q.weight", 12)
    assert stacked_name("model.layers.3.mlp.down_proj.weight", both) == ("model.layers.stacked.mlp.down_proj.weight", 3)
    for other in ("img_in.weight", "model.norm.weight", "model.embed_tokens.weight", "transformer_blocks.x.a",
                  "decoder.up_blocks.0.resnets.0.conv1.weight", "transformer_blocks.stacked.attn.to_q.weight"):
        assert stacked_name(other, both) is None, other
    assert stacked_name("model.layers.3.mlp.up_proj.weight", "transformer_blocks") is None
    assert layer_name("model.layers.stacked.mlp.up_proj.weight", 5) == "model.layers.5.mlp.up_proj.weight"


@pytest.mark.parametrize("kind", ["transformer", "text_encoder"])
def test_stacking_round_trip(kind):
    cfg = preset("tiny-alt")[kind]
    if kind == "transformer":
        config, prefix = MMDiTConfig.from_dict(cfg), "transformer_blocks"
        ref, looped = sensitize_(QwenMMDiT(config)), LoopedMMDiT(config)
    else:
        config, prefix = TextEncoderConfig.from_dict(cfg), "model.layers"
        ref, looped = sensitize_(QwenTextEncoder(config)), LoopedTextEncoder(config)
    sd = ref.state_dict()
    stacked = stack_block_weights(sd, prefix, config.num_layers)
    # The looped module's names and shapes are exactly the stacked ones; the template adds no tensor.
    assert {k: v.shape for k, v in looped.state_dict().items()} == {k: v.shape for k, v in stacked.items()}
    assert not any(".template." in k for k in looped.state_dict())
    # Slice i of each stack is layer i's tensor, bit for bit; unstacking gives the state dict back.
    for name, t in sd.items():
        hit = stacked_name(name, prefix)
        want = stacked[hit[0]][hit[1]] if hit else stacked[name]
        assert torch.equal(t, want), name
    back = unstack_block_weights(stacked)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # The shard stage's form: the stack is the concatenation of its slices' bytes, in layer order.
    name = next(k for k in stacked if ".stacked." in k)
    flat = torch.cat([sd[layer_name(name, i)].reshape(-1) for i in range(config.num_layers)])
    assert torch.equal(stacked[name].reshape(-1), flat)
    # Built the way the build does: on the meta device, then memory tensors assigned.
    with torch.device("meta"):
        meta = LoopedMMDiT(config) if kind == "transformer" else LoopedTextEncoder(config)
    load_weights(meta, stacked, kind, assign=True)
    assert all(p.device.type == "cpu" for p in meta.parameters())
    # Refusals name the tensor.
    missing = dict(sd)
    del missing[f"{prefix}.1.{name.split('.stacked.')[1]}"]
    with pytest.raises(CheckpointError, match=rf"{prefix}\.1\."):
        stack_block_weights(missing, prefix, config.num_layers)
    with pytest.raises(CheckpointError, match="layers"):
        stack_block_weights(sd, prefix, config.num_layers - 1)


# ------------------------------------------------------------------------------------------ eager parity

def test_looped_mmdit_matches_unrolled(denoisers):
    ref, looped, config, grid = denoisers
    x, e, t, mask, cos, sin = _mmdit_inputs(config, grid)
    with torch.no_grad():
        for m in (None, mask):
            want = ref(x, e, m, t, cos, sin)
            got = looped(x, e, m, t, cos, sin)
            assert torch.equal(got, want)
        # The check can fail: the stacks' layer order matters far beyond the bound.
        base = looped(x, e, None, t, cos, sin)
        flipped = {k: (v.flip(0) if ".stacked." in k else v) for k, v in looped.state_dict().items()}
        moved = torch.func.functional_call(looped, flipped, (x, e, None, t, cos, sin))
        assert rel_l2(moved, base) > 100 * TOL


def test_looped_step_matches_unrolled(denoisers):
    ref, looped, config, grid = denoisers
    x, e, _, mask, cos, sin = _mmdit_inputs(config, grid, seed=1)
    latents = x[:1]
    rest = (torch.tensor(600.0), torch.tensor(0.6), torch.tensor(0.45), torch.tensor(3.0), cos, sin)
    with torch.no_grad():
        for m in (None, mask):
            want = DenoiseStep(ref)(latents, e, m, *rest)
            got = DenoiseStep(looped)(latents, e, m, *rest)
            assert torch.equal(got, want)


def test_looped_text_encoder_matches_unrolled(encoders):
    ref, looped, config = encoders
    for valid in (12, 9):  # every token valid; right padding
        ids, mask = _ids(config, valid=valid)
        with torch.no_grad():
            got, want = looped(ids, mask), ref(ids, mask)
        assert torch.equal(got, want)


def test_looped_under_dynamo():
    """torch.compile and strict export trace through dynamo, which takes scan only via its public wrapper."""
    ref, looped, config = _encoder_pair("tiny")
    ids, mask = _ids(config)
    with torch.no_grad():
        got = torch.compile(looped, backend="eager", fullgraph=True)(ids, mask)
        assert torch.equal(got, ref(ids, mask))


def test_row_linear_reduce_runs_in_the_loop():
    """A TP plan sets RowLinear.reduce from outside; the looped body must call it once per layer."""
    config = MMDiTConfig.from_dict(preset("tiny")["transformer"])
    ref = sensitize_(QwenMMDiT(config)).eval()
    looped = LoopedMMDiT(config).eval()
    load_weights(looped, stack_block_weights(ref.state_dict(), "transformer_blocks", config.num_layers), "transformer")
    rows = [n for n, m in looped.named_modules() if isinstance(m, RowLinear) and n.startswith("transformer_blocks.")]
    assert rows == ["transformer_blocks.template.attn.to_out.0", "transformer_blocks.template.attn.to_add_out",
                    "transformer_blocks.template.img_mlp.net.2", "transformer_blocks.template.txt_mlp.net.2"]
    for model in (ref, looped):
        for m in model.modules():
            if isinstance(m, RowLinear):
                m.reduce = lambda y: 1.5 * y  # stands in for an all-reduce (sum over ranks)
    x, e, t, mask, cos, sin = _mmdit_inputs(config, GRIDS["tiny"])
    with torch.no_grad():
        got, want = looped(x, e, mask, t, cos, sin), ref(x, e, mask, t, cos, sin)
        for m in looped.modules():
            if isinstance(m, RowLinear):
                del m.reduce
        plain = looped(x, e, mask, t, cos, sin)
    assert torch.equal(got, want)
    assert rel_l2(plain, want) > 100 * TOL  # the hook did change the result


# ------------------------------------------------------------------------------------------ export / compile

def _nodes(gm: torch.fx.GraphModule, op) -> int:
    """Calls of `op` (an operator, or a substring of an aten op's name) in one graph, not its subgraphs."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and (n.target is op if not isinstance(op, str) else op in str(n.target)))


def test_export_looped_step_graph():
    """The step graph exactly as the build exports it (StepGraph, WeightsAsInputs): one scan, one layer body."""
    ref, looped, config, _ = _denoiser_pair("tiny-alt")
    height, width, bucket = 48, 32, 0  # exact-length text: the dynamic-shape form, the harder one
    gdef, gref = (denoiser_graph(m, config, 8, height, width, bucket, "float32") for m in (looped, ref))
    module = gdef.module.eval()
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    names = list(tensors)
    args = [t.clone() for _, t in gdef.inputs]
    g = torch.Generator().manual_seed(2)
    # packed CFG (exact length, one image): the prompt's and the negative prompt's text at their own lengths
    assert [n for n, _ in gdef.inputs][1:3] == ["text_embeds", "negative_embeds"]
    args[:3] = [torch.randn(a.shape, generator=g) for a in args[:3]]
    dynamic = (tuple(gdef.dynamic.get(n) for n, _ in gdef.inputs), [None] * len(names))
    weights = [tensors[n] for n in names]
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(module, names), (tuple(args), weights), dynamic_shapes=dynamic)
    gm = program.graph_module
    assert _nodes(gm, torch.ops.higher_order.scan) == 1
    assert _nodes(gm, "scaled_dot_product_attention") == 0  # no unrolled block outside the loop
    bodies = [m for n, m in gm.named_children() if n.startswith("scan_combine")]
    assert len(bodies) == 1 and _nodes(bodies[0], "scaled_dot_product_attention") == 2   # one per CFG branch
    latents = args[0]
    with torch.no_grad():
        got = program.module()(tuple(args), weights)
        assert torch.equal(got, gref.module.eval()(*args))
        # Other text lengths through the same program (the dynamic dims: the branches' lengths apart) ...
        short = [latents, args[1][:, :5].contiguous(), args[2][:, :2].contiguous(), *args[3:]]
        got = program.module()(tuple(short), weights)
        assert torch.equal(got, gref.module(*short))
        # ... and the stacks really are graph inputs: other weights, other result, matching eager.
        other = [w * 1.05 if ".stacked." in n else w for n, w in zip(names, weights)]
        moved = program.module()(tuple(args), other)
        want = torch.func.functional_call(module, dict(zip(names, other)), tuple(args))
        assert torch.equal(moved, want)
        assert rel_l2(moved - latents, got - latents) > 100 * TOL


@pytest.mark.slow
def test_aot_compiled_looped_text_encoder(tmp_path):
    """The one compile of this file: export -> InductorBackend.compile (asserts no baked constant) -> the
    runtime loader with weights as trailing inputs."""
    from qic.backends.base import Traced
    from qic.backends.inductor.build import InductorBackend
    from qic.backends.inductor.load import load

    ref, looped, config = _encoder_pair("tiny")
    names = [n for n, _ in looped.named_parameters()]
    weights = [looped.get_parameter(n) for n in names]
    ids, mask = _ids(config)
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(looped, names), ((ids, mask), weights))
    assert _nodes(program.graph_module, torch.ops.higher_order.scan) == 1
    InductorBackend("cpu").compile(Traced(None, names, program), tmp_path)
    run = load(tmp_path / "graph.pt2", weights, "cpu")
    with torch.no_grad():
        want = ref(ids, mask)
        assert rel_l2(run([ids, mask])[0], want) <= COMPILED_TOL
        # The compiled loop reads the stacks it is given: bind the reversed layer order.
        flipped = [w.flip(0).contiguous() if ".stacked." in n else w for n, w in zip(names, weights)]
        run_flipped = load(tmp_path / "graph.pt2", flipped, "cpu")
        want_flipped = torch.func.functional_call(looped, dict(zip(names, flipped)), (ids, mask))
        assert rel_l2(run_flipped([ids, mask])[0], want_flipped) <= COMPILED_TOL
        assert rel_l2(want_flipped, want) > 100 * COMPILED_TOL
