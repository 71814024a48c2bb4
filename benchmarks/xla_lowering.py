"""The neuron back end's lowering, measured and checked on XLA:CPU (run with .venv-xla's python).

    python -m benchmarks.xla_lowering tp N        # TP=N HLO: replica groups, host transfers, N-device run vs TP=1
    python -m benchmarks.xla_lowering step-cache N  # step caching's split graphs at TP=N, the same checks
    python -m benchmarks.xla_lowering sensitivity-ranks N  # the build's N-rank check, right and broken twice
    python -m benchmarks.xla_lowering depth       # looped (While) vs a host loop over one block vs unrolled
    python -m benchmarks.xla_lowering depth-sizes # only the HLO sizes and lowering times (seconds to run)
    python -m benchmarks.xla_lowering real HxW    # the real Qwen-Image configs lowered from shapes alone
    python -m benchmarks.xla_lowering --smoke     # `depth` at 1 and 2 blocks, one timed step each

Each prints one JSON object (tests/test_neuron_xla.py asserts on it; docs/benchmarks.md keeps the figures).
`tp N` (and the other N-rank commands) must start with CPU_NUM_DEVICES=N in the environment (torch-xla reads it once).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from qic.backends.neuron import hlo_proto
from qic.backends.neuron import lower as xl
from qic.builder.graphs import make_graph
from qic.checkpoint import presets
from qic.models.looped import stack_block_weights
from qic.models.qwen_image.components import COMPONENTS
from qic.models.qwen_image.graphs import denoiser_graph, text_encoder_graph, vae_decoder_graph
from qic.parallel.mesh import Layout

REAL_CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen-image-configs"
HOST_TRANSFER_OPS = ("send", "recv", "send-done", "recv-done", "infeed", "outfeed")


def _configs(preset: str = "tiny", text_encoder: dict | None = None, **transformer_overrides):
    p = presets.preset(preset)
    p["transformer"].update(transformer_overrides)
    p["text_encoder"].update(text_encoder or {})
    return {name: COMPONENTS[name].parse_config(p[c.folder]) for name, c in COMPONENTS.items()}


def _random(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights drawn large enough that every block changes the output (default inits nearly vanish)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
    return module.eval()


def _inputs(gdef, seed: int = 1):
    from qic.backends.neuron.build import check_inputs
    del seed
    tensors = dict(gdef.module.named_parameters())
    return check_inputs(gdef.inputs, tensors)


def _graph(component: str, module, cfgs, res=(48, 80), bucket=128, dtype="float32"):
    if component == "denoiser":
        return denoiser_graph(module, cfgs["denoiser"], cfgs["vae_decoder"].scale_factor, *res, bucket, dtype)
    if component == "text_encoder":
        return text_encoder_graph(module, bucket)
    return vae_decoder_graph(module, *res)


# ------------------------------------------------------------------------------------------------ tp

def tp_check(tp: int) -> dict:
    """Each TP component's looped graph at TP=tp: lowered, executed on tp XLA:CPU devices with every
    rank's own weight shard, compared with the TP=1 eager module on the same (unsharded) weights."""
    from qic.builder.binding import fake_world
    from qic.parallel.tp import apply_tp, shard_state_dict
    # The tiny text encoder has 2 key/value heads (TP may not exceed them): give it as many as ranks.
    cfgs = _configs(text_encoder={"num_key_value_heads": max(tp, 2)})
    fake_world(Layout(tp))
    out = {}
    for component, prefix in (("denoiser", "transformer_blocks"), ("text_encoder", "model.layers")):
        comp, cfg = COMPONENTS[component], cfgs[component]
        full = _random(comp.make_module(cfg, tp_size=1, looped=False))
        g1 = _graph(component, full, cfgs)
        inputs = _inputs(g1)
        with torch.no_grad():
            want = g1.module(*[t for _, t in inputs])
        mod = comp.make_module(cfg, tp_size=tp, looped=True)
        apply_tp(mod)
        g = _graph(component, mod, cfgs)
        names = dict(g.module.named_parameters())
        names.update(g.module.named_buffers())
        t0 = time.perf_counter()
        low = xl.lower(g.module, g.inputs, names, tp=tp)
        seconds = time.perf_counter() - t0
        owned = dict(g1.module.named_buffers())
        per_rank = []
        for r in range(tp):
            shard = stack_block_weights(shard_state_dict(component, full.state_dict(), r, tp), prefix, cfg.num_layers)
            weights = {**owned, **{g.weight_prefix + k: v for k, v in shard.items()}}
            per_rank.append(low.values(inputs, weights))
        outs = xl.execute_ranks(low.proto, per_rank)
        # The comparison can fail: rank 0 holding rank 1's shard as well breaks the sum.
        wrong = xl.execute_ranks(low.proto, [per_rank[1]] + per_rank[1:])
        ops = hlo_proto.opcodes(low.proto)
        w = want.flatten().float()
        out[component] = {
            "hlo_bytes": len(low.proto), "lower_seconds": round(seconds, 3),
            "all_reduce": ops["all-reduce"], "all_gather": ops["all-gather"], "while": ops["while"],
            "replica_groups": sorted({json.dumps(g) for op in ("all-reduce", "all-gather")
                                      for g in hlo_proto.replica_groups(low.proto, op)}),
            "host_transfers": sum(ops[o] for o in HOST_TRANSFER_OPS),
            "cos": [torch.nn.functional.cosine_similarity(o[0].flatten().float(), w, 0).item() for o in outs],
            "rel_l2": [((o[0].flatten().float() - w).norm() / w.norm()).item() for o in outs],
            # max-abs over the output's largest magnitude: the elementwise error on the output's own scale
            "max_abs_rel": [((o[0].flatten().float() - w).abs().max() / w.abs().max()).item() for o in outs],
            "wrong_shard_cos": torch.nn.functional.cosine_similarity(wrong[0][0].flatten().float(), w, 0).item(),
            "wrong_shard_rel_l2": ((wrong[0][0].flatten().float() - w).norm() / w.norm()).item(),
        }
    return out


# ------------------------------------------------------------------------------------------------ layouts

COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all")


def layout_check(tp: int, ulysses: int, cfg: int) -> dict:
    """The step graph under a mesh layout (qic/parallel/mesh.py) at 48x80 (15 image tokens) and text bucket 129
    (95 tokens): both odd, so Ulysses pads. Unrolled blocks (no While, so the HLO's collectives are all in
    the entry and body computations once each). Lowered, executed on world XLA:CPU devices, each rank with its
    TP shard and its mesh coordinates as inputs, compared with the TP=1 eager step by its prediction
    (prediction_error), and again with every rank fed rank 0's coordinates (wrong_coords: must be far off); the
    collectives' replica groups and the bytes they move, as counted in the HLO."""
    from qic.builder.binding import fake_world
    from qic.models.qwen_image.graphs import rank_inputs
    from qic.parallel.tp import shard_state_dict
    layout = Layout(tp, ulysses, cfg)
    cfgs = _configs()
    fake_world(layout)
    comp, cfg_ = COMPONENTS["denoiser"], cfgs["denoiser"]
    full = _random(comp.make_module(cfg_, tp_size=1, looped=False))
    g1 = _graph("denoiser", full, cfgs, bucket=129)
    inputs = euler_whole(_inputs(g1))
    with torch.no_grad():
        want = g1.module(*[t for _, t in inputs])
    mod = comp.make_module(cfg_, tp_size=tp, looped=False)
    g = make_graph("denoiser", mod, cfgs, {"resolution": [48, 80], "bucket": 129}, "float32", layout)
    names = dict(g.module.named_parameters())
    names.update(g.module.named_buffers())
    low = xl.lower(g.module, g.inputs, names, groups=g.groups)
    owned = dict(g1.module.named_buffers())

    def feeds(coords):   # every rank's input values, its mesh coordinates from coords(rank)
        out = []
        for r in range(layout.world):
            c = coords(r)
            shard = shard_state_dict("denoiser", full.state_dict(), c["tp"], tp)
            feed = inputs + [(n, torch.tensor([c[RANK_AXES[n]]])) for n in rank_inputs(g.module.step)]
            out.append(low.values(feed, {**owned, **{g.weight_prefix + k: v for k, v in shard.items()}}))
        return out
    outs = xl.execute_ranks(low.proto, feeds(layout.coords))
    # The check can fail: every rank fed rank 0's sequence and CFG coordinates (its own TP shard) computes rank
    # 0's chunk and branch, so each all-gather / all-to-all collects one rank's piece where the others' belong.
    wrong = xl.execute_ranks(low.proto, feeds(lambda r: layout.coords(r) | {"sp": 0, "cfg": 0}))
    ops = hlo_proto.opcodes(low.proto)
    w = want.flatten().double()
    latents = dict(inputs)["latents"]
    return {
        "layout": layout.as_dict(), "ops": {op: ops[op] for op in COLLECTIVE_OPS},
        "replica_groups": {op: sorted({json.dumps(x) for x in hlo_proto.replica_groups(low.proto, op)})
                           for op in COLLECTIVE_OPS},
        "expected_groups": {a: json.dumps(layout.groups(a)) for a in ("tp", "sp", "cfg")},
        "collective_bytes": hlo_proto.collective_bytes(low.proto, COLLECTIVE_OPS),
        "host_transfers": sum(ops[o] for o in HOST_TRANSFER_OPS),
        "cos": [torch.nn.functional.cosine_similarity(o[0].flatten().double(), w, 0).item() for o in outs],
        "prediction": [prediction_error(latents, o[0], want) for o in outs],
        "wrong_coords": [prediction_error(latents, o[0], want) for o in wrong],
    }


def euler_whole(inputs: list) -> list:
    """The step's inputs with sigma 1 -> 0, so next latents = latents - v: the guided prediction v is as large in
    the output as the input it is added to (at the example 0.5 -> 0.4 it is a tenth of it, and a comparison of
    next latents mostly compares the latents input with itself)."""
    whole = {"sigma": torch.tensor(1.0), "sigma_next": torch.tensor(0.0)}
    return [(n, whole.get(n, t)) for n, t in inputs]


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    """rel-L2 and max-abs of got against want (fp64), with want's largest magnitude (max-abs's scale)."""
    got, want = got.double(), want.double()
    return {"rel_l2": ((got - want).norm() / want.norm()).item(), "max_abs": (got - want).abs().max().item(),
            "scale": want.abs().max().item()}


def prediction_error(latents: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> dict:
    """errors() of the prediction v = latents - next latents (sigma 1 -> 0: euler_whole), in fp64 from the fp32
    outputs; `rounding`: the part of rel-L2 that the two fp32 roundings of next latents may add, 2u |next| / |v|
    (the outputs round to fp32 before v is recovered; the graphs' v itself is never rounded alone)."""
    out = errors(latents.double() - got.double(), latents.double() - want.double())
    u = torch.finfo(torch.float32).eps / 2
    return out | {"rounding": 2 * u * want.double().norm().item() / (latents.double() - want.double()).norm().item()}


RANK_AXES = {"cfg_rank": "cfg", "sp_rank": "sp"}
PARTS = (("head", None), ("rest", None), ("mixed", 1), ("mid", 1), ("tail", None))


# What each part's check compares: the outputs that are not mostly an input passed through. The middle's img and
# txt are its inputs plus their residuals, so its residuals are compared; the tail's next latents are the latents
# input plus the update, so its prediction is (sigma 1 -> 0: euler_whole); the rest (middle and tail) has both; the
# head's outputs are all computed.
CHECKED = {"head": ("img", "txt", "temb", "residual", "diff"), "mid": ("img_residual", "txt_residual"),
           "tail": ("prediction",), "rest": ("prediction", "img_residual", "txt_residual"),
           "mixed": ("prediction", "img_residual", "txt_residual")}


def step_cache_check(tp: int, first: int = 1, last: int = 1) -> dict:
    """Step caching's split graphs (head, rest, mixed, mid over one row, tail) of a 4-block denoiser at TP=tp:
    lowered, executed on tp XLA:CPU devices with each rank's shard, every CHECKED output compared with the TP=1
    eager part on the same weights; plus a host transfer count (a decision read inside a graph would be one).
    Two broken runs show the comparison can fail: the text mask dropped (every key attended), and at tp > 1
    rank 0 holding rank 1's shard (its all-reduces sum one shard twice)."""
    from qic.builder.binding import fake_world
    from qic.models.qwen_image.graphs import step_part_graph
    from qic.parallel.tp import apply_tp, shard_state_dict
    cfgs = _configs(num_layers=4)
    fake_world(Layout(tp))
    comp, cfg = COMPONENTS["denoiser"], cfgs["denoiser"]
    full = _random(comp.make_module(cfg, tp_size=1, looped=False))
    mod = comp.make_module(cfg, tp_size=tp, looped=True)
    apply_tp(mod)
    out = {}
    for part, rows in PARTS:
        def make(m):
            return step_part_graph(m, cfg, cfgs["vae_decoder"].scale_factor, 48, 80, 128, "float32", part, first,
                                   last, rows=rows)
        g1, g = make(full), make(mod)
        inputs = euler_whole(_inputs(g1))
        with torch.no_grad():
            want = g1.module(*[t for _, t in inputs])
        want = list(want) if isinstance(want, tuple) else [want]
        names = dict(g.module.named_parameters())
        names.update(g.module.named_buffers())
        low = xl.lower(g.module, g.inputs, names, tp=tp)
        owned = dict(g1.module.named_buffers())
        shards = [{**owned, **{g.weight_prefix + k: v for k, v in stack_block_weights(
            shard_state_dict("denoiser", full.state_dict(), r, tp), "transformer_blocks", cfg.num_layers).items()}}
            for r in range(tp)]
        outs = xl.execute_ranks(low.proto, [low.values(inputs, shards[r]) for r in range(tp)])
        unmasked = [(n, torch.ones_like(t) if n == "text_mask" else t) for n, t in inputs]
        broken = {"mask_dropped": xl.execute_ranks(low.proto, [low.values(unmasked, w) for w in shards])}
        if tp > 1:
            wrong = shards[1:2] + shards[1:]            # rank 0 with rank 1's shard
            broken["wrong_shard"] = xl.execute_ranks(low.proto, [low.values(inputs, w) for w in wrong])
        ops = hlo_proto.opcodes(low.proto)
        feed = dict(inputs)

        def checked(rank_out):   # {output name: errors()} of the CHECKED outputs of one rank
            got, ref = dict(zip(g.outputs, rank_out)), dict(zip(g.outputs, want))
            return {n: prediction_error(feed["latents"], got["latents"], ref["latents"]) if n == "prediction"
                    else errors(got[n], ref[n]) for n in CHECKED[part]}

        def cos(a, b):
            return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()
        out[g.name] = {
            "outputs": len(want), "all_reduce": ops["all-reduce"], "while": ops["while"],
            "host_transfers": sum(ops[o] for o in HOST_TRANSFER_OPS),
            "replica_groups": sorted({json.dumps(x) for op in ("all-reduce", "all-gather")
                                      for x in hlo_proto.replica_groups(low.proto, op)}),
            # per rank, the worst output's cosine against TP=1 eager (every output, pass-through ones included)
            "cos": [min(cos(o, w) for o, w in zip(rank_out, want)) for rank_out in outs],
            "checked": [checked(rank_out) for rank_out in outs],
            **{name: [checked(rank_out) for rank_out in o] for name, o in broken.items()},
        }
    return out


# ------------------------------------------------------------------------------------------------ depth

def _lower_denoiser(blocks: int, looped: bool, values: bool = False, res=(48, 80)):
    cfgs = _configs(num_layers=blocks)
    comp = COMPONENTS["denoiser"]
    if values:
        module = _random(comp.make_module(cfgs["denoiser"], looped=looped))
    else:
        with torch.device("meta"):
            module = comp.make_module(cfgs["denoiser"], looped=looped)
    g = _graph("denoiser", module, cfgs, res)
    tensors = dict(g.module.named_parameters())
    tensors.update(g.module.named_buffers())
    t0 = time.perf_counter()
    low = xl.lower(g.module, g.inputs, tensors)
    return g, tensors, low, time.perf_counter() - t0


def _step_seconds(low, g, tensors, repeats: int = 3) -> float:
    """One execution of the whole step graph, parameters already on the device (as the runtime holds
    weights), the output read back."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    comp = xb.computation_from_module_proto("step", low.proto)
    dev = torch_xla.device()
    params = [p.to(dev) for p in low.values(_inputs(g), tensors)]

    def step():
        return torch_xla._XLAC._xla_user_computation("qic::step", params, comp)[0].cpu()

    step()                                             # compile once
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - t0) / repeats


def _host_loop(blocks: int, repeats: int = 3) -> dict:
    """The alternative: one compiled block graph, run `blocks` times by the host per step."""
    import torch_xla
    cfgs = _configs(num_layers=1)
    model = _random(COMPONENTS["denoiser"].make_module(cfgs["denoiser"], looped=False))
    block = model.transformer_blocks[0]
    rows, cols = 6, 10   # the 48x80 grid packed (vae scale 4, patch 2)
    dim = cfgs["denoiser"].num_attention_heads * cfgs["denoiser"].attention_head_dim
    gen = torch.Generator().manual_seed(0)
    img, txt = torch.randn(2, rows * cols, dim, generator=gen), torch.randn(2, 94, dim, generator=gen)
    temb = torch.randn(2, dim, generator=gen)
    from qic.models.qwen_image.mmdit import rope_tables
    cos, sin = rope_tables(cfgs["denoiser"], rows, cols, 94)
    inputs = [("img", img), ("txt", txt), ("temb", temb), ("mask", None), ("cos", cos), ("sin", sin)]
    real = [(n, t) for n, t in inputs if t is not None]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, img, txt, temb, cos, sin):
            return self.block(img, txt, temb, None, cos, sin)

    wrapper = Block().eval()
    weights = dict(wrapper.named_parameters())
    t0 = time.perf_counter()
    low = xl.lower(wrapper, real, weights)
    lower_s = time.perf_counter() - t0
    params = low.values(real, weights)
    import torch_xla.core.xla_builder as xb
    comp = xb.computation_from_module_proto("block", low.proto)
    dev = torch_xla.device()
    dev_params = [p.to(dev) for p in params]
    i_img = next(i for i, p in enumerate(low.param_order) if p["name"] == "img")
    i_txt = next(i for i, p in enumerate(low.param_order) if p["name"] == "txt")

    def step():
        args = list(dev_params)
        for _ in range(blocks):
            a, b = torch_xla._XLAC._xla_user_computation("qic::block", args, comp)
            torch_xla.sync()   # one device launch per block, as a host loop over a NEFF would do
            args[i_img], args[i_txt] = a, b
        return args[i_img].cpu()

    step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    return {"hlo_bytes": len(low.proto), "lower_seconds": round(lower_s, 3),
            "step_seconds": round((time.perf_counter() - t0) / repeats, 4)}


def depth_sizes(sizes=(4, 60)) -> dict:
    """HLO size and lowering time of the denoise step at 4 and 60 blocks, looped and unrolled (shapes only)."""
    out = {"looped": {}, "unrolled": {}}
    for blocks in sizes:
        for mode in out:
            _, _, low, s = _lower_denoiser(blocks, looped=mode == "looped")
            out[mode][blocks] = {"hlo_bytes": len(low.proto), "lower_seconds": round(s, 3)}
    return out


def depth(sizes=(4, 60), timed=(4, 16), repeats: int = 3) -> dict:
    """depth_sizes plus XLA:CPU step time: While loop, host loop over one block graph, unrolled."""
    out = {**depth_sizes(sizes), "host_loop": {}}
    for blocks in timed:
        for mode in ("looped", "unrolled"):
            g, tensors, low, _ = _lower_denoiser(blocks, looped=mode == "looped", values=True)
            out[mode].setdefault(blocks, {})["step_seconds"] = round(_step_seconds(low, g, tensors, repeats), 4)
        out["host_loop"][blocks] = _host_loop(blocks, repeats)
    return out


# ------------------------------------------------------------------------------------------------ real

def real(height: int, width: int, bucket: int = 256) -> dict:
    """The real Qwen-Image configs at one resolution: every graph lowered from shapes (meta tensors; a
    graph does not depend on weight values), HLO sizes against the 2 GB protobuf limit."""
    raw = {f: json.loads((REAL_CONFIGS / f / "config.json").read_text())
           for f in ("text_encoder", "transformer", "vae")}
    cfgs = {name: c.parse_config(raw[c.folder]) for name, c in COMPONENTS.items()}
    out = {}
    for component in ("text_encoder", "denoiser", "vae_decoder"):
        comp = COMPONENTS[component]
        dtype = "float32" if component == "vae_decoder" else "bfloat16"
        with torch.device("meta"):
            module = comp.make_module(cfgs[component], looped=comp.stackable).to(getattr(torch, dtype))
            g = _graph(component, module, cfgs, (height, width), bucket, dtype)
        tensors = dict(g.module.named_parameters())
        tensors.update(g.module.named_buffers())
        t0 = time.perf_counter()
        low = xl.lower(g.module, g.inputs, tensors)
        out[g.name] = {"hlo_bytes": len(low.proto), "lower_seconds": round(time.perf_counter() - t0, 2),
                       "parameters": len(low.param_order), "while": hlo_proto.opcodes(low.proto)["while"],
                       "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    return out


def sensitivity() -> dict:
    """The XLA:CPU check's bound can fail: the tiny denoise step's rel-L2 against eager with the right
    inputs, with the text mask's padding dropped, and with one block's weights zeroed."""
    from qic.backends.neuron.build import NeuronBackend
    g, tensors, low, _ = _lower_denoiser(3, looped=True, values=True)
    backend = NeuronBackend.__new__(NeuronBackend)
    right = backend.check(low, g.module, g.inputs, tensors)["xla_cpu_rel_l2"]
    inputs = _inputs(g)
    feed = dict(inputs)
    unpadded = {**feed, "text_mask": torch.ones_like(feed["text_mask"])}
    with torch.no_grad():
        want = torch.func.functional_call(g.module, tensors, tuple(t for _, t in inputs))
    got_mask = xl.execute(low.proto, low.values(list(unpadded.items()), tensors))[0]
    name = next(n for n in tensors if "stacked" in n and n.endswith("img_mlp.net.2.weight"))
    broken = dict(tensors)
    broken[name] = tensors[name].clone()
    broken[name][1] = 0
    got_w = xl.execute(low.proto, low.values(inputs, broken))[0]

    def rel(x):
        return ((x.float() - want.float()).norm() / want.float().norm()).item()

    return {"right": right, "mask_dropped": rel(got_mask), "block_zeroed": rel(got_w)}


def sensitivity_ranks(tp: int = 2) -> dict:
    """The build's multi-rank check (NeuronBackend.check at tp ranks on tp XLA:CPU devices) can fail: the TP
    text encoder and denoise step as built, lowered with each rank reducing alone (replica groups {{r}}: no
    all-reduce across ranks), and checked against eager run without the in-memory collectives (the fake
    process group's: each rank's partial sum). Per case the check's rel-L2 (rank worst; NaN where a broken
    gather made garbage) and verdict."""
    from qic.backends.neuron.build import NeuronBackend, rank_sample, rank_weights
    from qic.builder.binding import fake_world
    from qic.parallel.tp import apply_tp
    cfgs = _configs(text_encoder={"num_key_value_heads": max(tp, 2)}, num_layers=2)
    fake_world(Layout(tp))
    backend = NeuronBackend.__new__(NeuronBackend)
    world = {"0": [list(range(tp))]}
    out = {}
    for component in ("text_encoder", "denoiser"):
        mod = _random(COMPONENTS[component].make_module(cfgs[component], tp_size=tp, looped=True))
        apply_tp(mod)
        g = _graph(component, mod, cfgs)
        names = dict(g.module.named_parameters())
        names.update(g.module.named_buffers())
        right = xl.lower(g.module, g.inputs, names, groups=world)
        alone = xl.lower(g.module, g.inputs, names, groups={"0": [[r] for r in range(tp)]})
        sample = _inputs(g)
        unmet = []
        for r in range(tp):   # eager without the collectives modelled: the fake group returns its input
            with torch.no_grad():
                got = torch.func.functional_call(g.module, rank_weights(names, r),
                                                 tuple(t for _, t in rank_sample(sample, world, r)))
            unmet.append(got[0] if isinstance(got, tuple) else got)
        xla = xl.execute_ranks(right.proto, [right.values(rank_sample(sample, world, r), rank_weights(names, r))
                                             for r in range(tp)])
        checks = {case: backend.check(low, g.module, g.inputs, names, world, tp)
                  for case, low in (("right", right), ("reduced_alone", alone))}
        out[component] = {
            **{case: {"rel_l2": c["xla_cpu_rel_l2"], "ok": c["ok"]} for case, c in checks.items()},
            "eager_without_collectives": max(((x[0] - u).norm() / x[0].norm()).item() for x, u in zip(xla, unmet)),
        }
    return out


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "depth"
    if what == "--smoke":
        result = depth(sizes=(1, 2), timed=(1,), repeats=1)
    elif what == "tp":
        result = tp_check(int(argv[1]))
    elif what == "step-cache":
        result = step_cache_check(int(argv[1]))
    elif what == "layout":
        result = layout_check(*(int(v) for v in argv[1:4]))
    elif what == "sensitivity":
        result = sensitivity()
    elif what == "sensitivity-ranks":
        result = sensitivity_ranks(int(argv[1]))
    elif what == "depth-sizes":
        result = depth_sizes()
    elif what == "real":
        h, w = (int(v) for v in argv[1].split("x"))
        result = real(h, w)
    else:
        result = depth()
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
