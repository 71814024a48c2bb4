"""Issue 33: per-request LoRA on a slotted bundle (`qic build --lora-slots R`, qic.models.lora_slots): the adapters are
graph inputs, so one set of graphs runs any adapter at any strength. Against diffusers' load_lora_weights +
set_adapters (unfused), against the build-time merged bundle, two adapters at once, a batch of two requests with
different adapters against each alone, TP 2 against TP 1, and what is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qic.errors import ConfigError
from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate, generate_batch
from qic.runtime.lora import Adapters
from tests.conftest import TINY_RES, image_diff, qic
from tests.test_lora import MODULES, PROMPT, STEPS, _factors, write_lora
from tests.test_nocfg import BOUND_MAX, BOUND_MEAN

SLOTS = 8              # two rank-4 adapters fit side by side
MERGE_MAX = 2          # the bound against the merged bundle, in 1/255: W x + B (s A x) and (W + s B A) x differ
#                        only by fp32 reordering, far below one quantisation step (measured: at most 1)


def _build(ckpt, cache_dir, out, *extra):
    qic("build", "--model", ckpt, "--cache-dir", cache_dir, "--resolution", "{}x{}".format(*TINY_RES),
        "--text-buckets", "72", "--output", out, *extra)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, workdir):
    """Two rank-4 adapters of different key formats, on different modules (b's factors reseeded)."""
    d = workdir / "slot-loras"
    d.mkdir(exist_ok=True)
    a, b = d / "a.safetensors", d / "b.safetensors"
    write_lora("peft", _factors(tiny_ckpt), a)
    torch.manual_seed(3)
    write_lora("kohya", {m: (torch.randn_like(dn) * 0.5, torch.randn_like(up)) for m, (dn, up)
                         in _factors(tiny_ckpt).items() if m != "img_in"}, b)
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def slotted(tiny_ckpt, cache_dir, workdir):
    """The tiny model with slots, export back end (torch runs the exported program: the slot arithmetic without a
    compile), batch sizes 1 and 2."""
    return _build(tiny_ckpt, cache_dir, workdir / "bundle-slots-export", "--backend", "export", "--lora-slots",
                  str(SLOTS), "--batch-sizes", "1,2")


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from diffusers import QwenImagePipeline
    p = QwenImagePipeline.from_pretrained(str(tiny_ckpt), torch_dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _diffusers(pipe, loras: dict, seed: int = 0):
    """diffusers with the adapters loaded and weighted (set_adapters), not fused: what the slots compute."""
    for name, (path, _) in loras.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    if loras:
        pipe.set_adapters(list(loras), adapter_weights=[s for _, s in loras.values()])
    try:
        h, w = TINY_RES
        return pipe(PROMPT, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=STEPS, height=h, width=w,
                    generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    finally:
        if loras:
            pipe.unload_lora_weights()


def test_slots_are_the_merged_weights_eagerly():
    """A slotted denoiser (unrolled and looped) with zero slots is the base model, and with an adapter in its slots
    the model whose weights have it merged, within fp32 reordering (rel-L2 ~1e-7 measured; the adapter moves the
    output by ~1, so 1e-5 can fail)."""
    from qic.models import lora_slots
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT, rope_tables
    cfg = MMDiTConfig(2, 16, 16, 2, 8, 2, 32, (2, 2, 4))
    torch.manual_seed(0)
    base = QwenMMDiT(cfg)
    sd = base.state_dict()
    x, txt, t = torch.randn(2, 6, 16), torch.randn(2, 5, 32), torch.tensor([0.5, 0.5])
    cos, sin = rope_tables(cfg, 2, 3, 5)
    g = torch.Generator().manual_seed(1)
    adapter = {}
    for name in ("transformer_blocks.1.attn.to_q", "proj_out", "transformer_blocks.0.img_mlp.net.2",
                 "transformer_blocks.1.txt_mod.1"):
        lin = base.get_submodule(name)
        adapter[name] = (torch.randn(3, lin.in_features, generator=g), torch.randn(lin.out_features, 3, generator=g))
    merged = QwenMMDiT(cfg)
    merged.load_state_dict({k: v + 0.7 * adapter[k[:-7]][1] @ adapter[k[:-7]][0] if k[:-7] in adapter else v
                            for k, v in sd.items()})
    with torch.no_grad():
        ref, want = base(x, txt, None, t, cos, sin), merged(x, txt, None, t, cos, sin)
    for looped in (False, True):
        m = (LoopedMMDiT if looped else QwenMMDiT)(cfg)
        m.load_state_dict(stack_block_weights(sd, "transformer_blocks", 2) if looped else sd)
        names = lora_slots.attach(m, ".*", 4, 1, blocks="transformer_blocks")
        assert "proj_out" in names and ("transformer_blocks.{i}.attn.to_q" if looped else
                                        "transformer_blocks.1.attn.to_q") in names
        with torch.no_grad():
            zero = m(x, txt, None, t, cos, sin)
            assert (zero - ref).norm() / ref.norm() < 1e-5
            for name, (down, up) in adapter.items():
                block, _, rest = name.partition(".")[2].partition(".")
                if looped and name.startswith("transformer_blocks."):
                    slot = m.transformer_blocks.stacked.get_submodule(rest).lora_slot
                    down_, up_, scale_ = slot.down[int(block)], slot.up[int(block)], slot.scale[int(block)]
                else:
                    slot = m.get_submodule(name).lora_slot
                    down_, up_, scale_ = slot.down, slot.up, slot.scale
                down_[0, 1:4], up_[0, :, 1:4], scale_[0, 1:4] = down, up, 0.7   # columns 1-3 of 4: any will do
            got = m(x, txt, None, t, cos, sin)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5 and ((got - ref).norm() / ref.norm()).item() > 0.1, err


def test_plan_counts_the_slots_and_their_flops(tmp_path):
    """qic plan of a slotted build: the denoiser's graph inputs grow by the slot tensors (R x (in + out) + R per
    Linear and image), its FLOPs by their matmuls; the other components' graphs are unchanged."""
    from qic.builder.memplan import plan_memory
    from qic.builder.source import resolve_configs
    from qic.spec import parse_spec
    configs, raw = resolve_configs(None, tmp_path)
    plans = {}
    for slots in (0, SLOTS):
        spec = parse_spec({"resolutions": ["48x80"], "text_buckets": [128], "lora_slots": slots})
        plans[slots] = {g.component: g for g in plan_memory(spec, configs, raw, None).graphs}
    den = configs["denoiser"]
    linears = [(den.inner_dim, den.inner_dim)] * 8 + [(den.inner_dim, den.mlp_dim), (den.mlp_dim, den.inner_dim)] * 2 \
        + [(den.inner_dim, 6 * den.inner_dim)] * 2           # a block's: attention, MLPs, modulations
    per_block = sum(SLOTS * (i + o) + SLOTS for i, o in linears)
    plain, slotted = plans[0]["denoiser"], plans[SLOTS]["denoiser"]
    # fp32; the top-level Linears' slots come on top
    assert slotted.input_bytes - plain.input_bytes >= den.num_layers * per_block * 4
    assert slotted.flops > plain.flops
    assert plans[SLOTS]["text_encoder"].input_bytes == plans[0]["text_encoder"].input_bytes


def _run(bundle, *lora, seed: int = 0):
    return generate(bundle, Request(PROMPT, steps=STEPS, seed=seed, lora=list(lora) or None)).image


@pytest.mark.slow   # builds (export back end: no compile, but a build and diffusers runs each)
@pytest.mark.parametrize("scale", [0.5, 1.0])
def test_per_request_lora_equals_diffusers_and_the_merged_bundle(scale, slotted, adapters, pipe, tiny_ckpt, cache_dir,
                                                                workdir):
    b = Bundle(slotted)
    ours = _run(b, f"{adapters['a']}:{scale}")
    mx, mean = image_diff(ours, _diffusers(pipe, {"a": (adapters["a"], scale)}))
    print(f"slots, scale {scale}: qic vs diffusers set_adapters: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    merged = _build(tiny_ckpt, cache_dir, workdir / f"bundle-merged-{scale}", "--backend", "export", "--lora",
                    f"{adapters['a']}:{scale}")
    mx, _ = image_diff(ours, _run(Bundle(merged)))
    print(f"slots vs the merged bundle: max {mx:.0f}/255")
    assert mx <= MERGE_MAX
    base = _run(b)   # the bounds can fail: the same bundle without the adapter draws another image
    assert image_diff(base, ours)[0] > BOUND_MAX
    assert image_diff(base, _diffusers(pipe, {}))[0] <= BOUND_MAX


@pytest.mark.slow   # builds (export back end: no compile, but a build and diffusers runs each)
def test_two_adapters_at_once_and_a_batch_of_different_adapters(slotted, adapters, pipe):
    b = Bundle(slotted)
    a, bb = f"{adapters['a']}:0.5", f"{adapters['b']}:1.0"
    both = _run(b, a, bb)
    mx, mean = image_diff(both, _diffusers(pipe, {"a": (adapters["a"], 0.5), "b": (adapters["b"], 1.0)}))
    print(f"two adapters: qic vs diffusers: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    assert image_diff(both, _run(b, a))[0] > BOUND_MAX      # the second adapter counts
    # A batch of two requests (the @B2 graphs), one image with adapter a, the other with b and another seed: each as
    # it is alone (the batch-1 graph).
    reqs = [Request(PROMPT, steps=STEPS, seed=0, lora=[a]), Request(PROMPT, steps=STEPS, seed=1, lora=[bb])]
    batch = generate_batch(b, reqs)
    for got, alone in zip(batch, (_run(b, a), _run(b, bb, seed=1))):
        assert image_diff(got.image, alone)[0] <= BOUND_MAX
    swapped = generate_batch(b, [Request(PROMPT, steps=STEPS, seed=0, lora=[bb]),
                                 Request(PROMPT, steps=STEPS, seed=1, lora=[a])])
    assert image_diff(swapped[0].image, batch[0].image)[0] > BOUND_MAX   # each row reads its own image's slots
    assert b.adapters.misses == 2 and b.adapters.hits > 0    # each file read once


@pytest.mark.slow   # builds (export back end: no compile, but a build and diffusers runs each)
def test_a_scale_change_rebuilds_only_the_scales(slotted, adapters):
    b = Bundle(slotted)
    ad = Adapters(b, {"a": adapters["a"]})
    graph = b.graph("denoiser", TINY_RES, 72)
    one, half = ad.bind(graph, [[("a", 1.0)]]), ad.bind(graph, [[("a", 0.5)]])
    slots = {n: e for n, e in graph.lora_slots.items() if e["part"] != "scale"}
    assert slots and all(one.weights[n] is half.weights[n] for n in slots)
    scales = [n for n, e in graph.lora_slots.items() if e["part"] == "scale"]
    assert all(torch.equal(one.weights[n] * 0.5, half.weights[n]) for n in scales)
    assert any(one.weights[n].any() for n in scales)


@pytest.mark.slow   # builds (export back end: no compile, but a build and diffusers runs each)
def test_what_is_refused_in_one_line(slotted, adapters, bundle_export, tiny_ckpt, tmp_path):
    b = Bundle(slotted)
    with pytest.raises(ConfigError, match="no adapter named 'c'"):
        Adapters(b, {"a": adapters["a"]}).resolve([("c", 1.0)])
    big = tmp_path / "big.safetensors"      # rank 12 > 8 slots
    g = torch.Generator().manual_seed(0)
    save_file({f"{MODULES[2]}.lora_A.weight": torch.randn(12, 128, generator=g),
               f"{MODULES[2]}.lora_B.weight": torch.randn(128, 12, generator=g)}, str(big))
    with pytest.raises(ConfigError, match=r"rank 12 exceeds the bundle's slots \(--lora-slots 8\)"):
        Adapters(b, {"big": big})
    with pytest.raises(ConfigError, match="ranks add up to 12"):    # 4 + 4 + 4
        Adapters(b, {"a": adapters["a"], "b": adapters["b"]}).resolve([("a", 1), ("b", 1), ("a", 0.5)])
    with pytest.raises(ConfigError, match="built without --lora-slots"):
        generate(Bundle(bundle_export), Request(PROMPT, steps=STEPS, lora=[str(adapters["a"])]))
    proc = qic("run", slotted, "--prompt", PROMPT, "--lora", str(tmp_path / "none.safetensors"), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "none.safetensors not found" in errors[0], proc.stderr
    for flags, said in ((["--step-cache", "1,0", "--batch-sizes", "1,2", "--text-buckets", "72"],
                         "lora_slots with step_cache and batch sizes above 1: not yet"),
                        (["--backend", "neuron"], "lora_slots on the neuron back end: not yet")):
        proc = qic("build", "--model", tiny_ckpt, "--lora-slots", "4", *flags, "--output", tmp_path / "x",
                   check=False)
        assert proc.returncode != 0 and said in proc.stderr, proc.stderr


@pytest.mark.slow   # builds (export back end: no compile, but a build and diffusers runs each)
def test_slot_inputs_are_listed_and_no_shard_holds_them(slotted):
    import json
    m = json.loads((slotted / "manifest.json").read_text())
    assert m["lora_slots"] == SLOTS
    step = next(g for g in m["graphs"] if g["name"] == "denoiser@48x80@L72")
    slots = step["lora_slots"]
    # Every Linear of the denoiser (qic.models.qwen_image's lora_modules), stacked over the looped blocks.
    assert {"img_in", "proj_out", "transformer_blocks.{i}.attn.to_q", "transformer_blocks.{i}.img_mod.1"} <= \
        {e["module"] for e in slots.values()}
    assert all(n in step["weight_inputs"] for n in slots)
    assert not any("lora_slot" in n for n in step["owned_constants"])
    to_q = next(e for e in slots.values() if e["module"] == "transformer_blocks.{i}.attn.to_q" and e["part"] == "up")
    assert to_q["stacked"] and to_q["shape"][1:] == [1, 128, SLOTS] and to_q["split"] == 0   # column-parallel
    text = next(g for g in m["graphs"] if g["component"] == "text_encoder")
    assert text["lora_slots"] == {}


@pytest.mark.slow
def test_compiled_slots_at_tp1_and_tp2(slotted, tiny_ckpt, cache_dir, workdir, adapters, tmp_path):
    """The inductor bundle's slots (AOTInductor over the slot inputs), and at TP 2 the adapters cut as their base
    weights are (qic run launches the ranks): both the export bundle's image."""
    compiled = _build(tiny_ckpt, cache_dir, workdir / "bundle-slots", "--lora-slots", str(SLOTS))
    tp2 = _build(tiny_ckpt, cache_dir, workdir / "bundle-slots-tp2", "--backend", "export", "--tp", "2",
                 "--lora-slots", str(SLOTS))
    ref = _run(Bundle(slotted), f"{adapters['a']}:0.7", f"{adapters['b']}:0.3")
    for bundle, extra in ((compiled, []), (tp2, ["--tp", "2"])):
        out = tmp_path / f"{bundle.name}.png"
        qic("run", bundle, "--prompt", PROMPT, "--steps", str(STEPS), "--lora", f"{adapters['a']}:0.7", "--lora",
            f"{adapters['b']}:0.3", "--output", out, *extra)
        from PIL import Image
        got = Image.open(out)
        mx, mean = image_diff(got, ref)
        print(f"{bundle.name}: max {mx:.0f}/255 mean {mean:.4f}")
        assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    assert image_diff(ref, _run(Bundle(compiled)))[0] > BOUND_MAX


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--cfg-parallel",), ("--ulysses", "2")], ids=["cfg-parallel", "ulysses2"])
def test_slots_under_cfg_parallel_and_ulysses(slotted, tiny_ckpt, cache_dir, workdir, adapters, tmp_path, layout):
    """Two ranks per image, each CFG branch (CFG-parallel) or each half of the sequence (Ulysses) on a rank of its
    own (qic run launches them): every rank's rows take the image's adapters, so the image is the one-rank bundle's."""
    from PIL import Image
    bundle = _build(tiny_ckpt, cache_dir, workdir / f"bundle-slots{'-'.join(layout)}", "--backend", "export", *layout,
                    "--lora-slots", str(SLOTS))
    ref = _run(Bundle(slotted), f"{adapters['a']}:0.7", f"{adapters['b']}:0.3")
    out = tmp_path / "img.png"
    qic("run", bundle, "--prompt", PROMPT, "--steps", str(STEPS), "--lora", f"{adapters['a']}:0.7", "--lora",
        f"{adapters['b']}:0.3", "--output", out)
    mx, mean = image_diff(Image.open(out), ref)
    print(f"{' '.join(layout)}: max {mx:.0f}/255 mean {mean:.4f}")
    assert mx <= BOUND_MAX and mean <= BOUND_MEAN
    assert image_diff(ref, _run(Bundle(slotted)))[0] > BOUND_MAX   # the adapters change the image past the bound


@pytest.mark.slow
def test_served_requests_pick_adapters_and_strengths(slotted, adapters, tmp_path):
    """qic serve --lora NAME=FILE: a request's lora field picks adapters and strengths (the openai client's extra
    body), drawing qic run --lora's pixels; a name not served, or a file path, is a 400 naming it; /metrics counts
    the adapters' cache hits."""
    import base64
    import io

    from openai import BadRequestError, OpenAI
    from PIL import Image

    from qic.serve.client import request
    from tests.test_serve import ServeProcess
    srv = ServeProcess(slotted, tmp_path / "serve.log", "--lora", f"a={adapters['a']}", "--lora",
                       f"b={adapters['b']}", "--lora-budget", "1")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        size = "{1}x{0}".format(*TINY_RES)
        served = []
        for lora in ([{"name": "a", "scale": 0.5}], [{"name": "a", "scale": 1.0}, {"name": "b", "scale": 0.3}]):
            resp = client.images.generate(prompt=PROMPT, size=size, response_format="b64_json",
                                          extra_body={"steps": STEPS, "lora": lora})
            served.append(Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json))))
        for got, flags in zip(served, ([f"{adapters['a']}:0.5"], [f"{adapters['a']}:1.0", f"{adapters['b']}:0.3"])):
            out = tmp_path / "run.png"
            qic("run", slotted, "--prompt", PROMPT, "--steps", STEPS, *[x for f in flags for x in ("--lora", f)],
                "--output", out)
            assert image_diff(got, Image.open(out)) == (0.0, 0.0)
        assert image_diff(served[0], served[1])[0] > BOUND_MAX
        assert served[1].text["lora"] == "a:1, b:0.3"
        for name in ("c", str(adapters["a"])):
            with pytest.raises(BadRequestError, match=f"no adapter named {name!r}"):
                client.images.generate(prompt=PROMPT, size=size, extra_body={"lora": [{"name": name}]})
        status, _, text = request(srv.port, "GET", "/metrics")
        assert status == 200
        text = text if isinstance(text, str) else text.decode()
        assert 'qic_lora_adapter_uses_total{cache="hit"} 1.0' in text, text   # a's second use
        assert 'qic_lora_adapter_uses_total{cache="miss"} 2.0' in text and "qic_lora_adapters_loaded 2.0" in text
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log_path.read_text()


@pytest.mark.slow
def test_step_caching_runs_the_adapters_in_every_part(tiny_ckpt, cache_dir, workdir, adapters):
    """A slotted step-cache bundle (batch 1: head, rest, mixed, tail): a masked and a thresholded run with an adapter
    draw what the merged bundle's split graphs draw with the same settings, computing the same steps."""
    split = ["--backend", "export", "--step-cache", "1,0"]
    slots = _build(tiny_ckpt, cache_dir, workdir / "bundle-slots-cache", *split, "--lora-slots", str(SLOTS))
    merged = _build(tiny_ckpt, cache_dir, workdir / "bundle-merged-cache", *split, "--lora", f"{adapters['a']}:0.8")
    b, m = Bundle(slots), Bundle(merged)
    for cache in ({"cache_steps": "0,2"}, {"cache_threshold": 0.05}):
        steps = {"steps": 4, **cache}
        got = generate(b, Request(PROMPT, **steps, lora=[f"{adapters['a']}:0.8"]))
        want = generate(m, Request(PROMPT, **steps))
        mx, mean = image_diff(got.image, want.image)
        print(f"step cache {cache}: slots vs merged: max {mx:.0f}/255, computed {got.computed} / {want.computed}")
        assert got.computed == want.computed and mx <= MERGE_MAX
        plain = generate(b, Request(PROMPT, **steps))
        assert image_diff(plain.image, got.image)[0] > BOUND_MAX
