"""`qic plan`: the memory / disk / compile plan from configs alone (qic.builder.memplan, qic.cli.plan)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from benchmarks.peak import measure
from qic.builder.memplan import DEFAULT_COMPILE_SECONDS, estimate_graph, plan_memory, weight_bytes
from qic.builder.source import resolve_configs
from qic.checkpoint.presets import preset
from qic.cli import main
from qic.models.qwen_image.components import COMPONENTS
from qic.spec import parse_spec, with_changes
from tests.conftest import BUCKETS, TINY_RES, qic

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "fixtures" / "qwen-image-configs"   # the public Qwen/Qwen-Image configs, no weights
REAL_YAML = ROOT / "configs" / "qwen-image-512.yaml"        # bf16 text encoder and denoiser, fp32 VAE


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) >= 5:
            rows[cells[0]] = cells
    return rows


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_prints_real_qwen_image_at_tp(tp, tmp_path):
    res = CliRunner().invoke(main, ["plan", str(REAL_YAML), "--model", str(REAL), "--tp", str(tp),
                                    "--text-buckets", "128,", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = res.output
    print(out)
    assert f"tp={tp}" in out and "run:" in out and "3 graphs" in out
    rows = _table_rows(out)
    for name in ("text_encoder", "denoiser", "vae_decoder", "text_encoder@L128", "denoiser@512x512@L128",
                 "vae_decoder@512x512"):
        assert name in rows, name
    # TE and denoiser split across ranks (1.05x slack for what stays whole), the VAE replicated.
    for comp in ("text_encoder", "denoiser"):
        assert rows[comp][2] == str(tp) and float(rows[comp][4]) <= 1.05 / tp, rows[comp]
    assert rows["vae_decoder"][2] == "1" and rows["vae_decoder"][4] == "1.000"


REAL_21 = ROOT / "tests" / "fixtures" / "qwen-image-2.1-configs"   # the public Qwen/Qwen-Image-2.1 configs


@pytest.mark.parametrize("tp, cfg_parallel", [(1, False), (2, False), (4, False), (2, True)])
@pytest.mark.parametrize("res", [1024, 2048])
def test_plan_of_the_real_qwen_image_21_holds_its_prefix_kv_cache(tp, cfg_parallel, res, tmp_path):
    """The real 2.1 configs (the VAE's without latent statistics: diffusers' published defaults) plan at 1024 and
    2048 px at TP 1, 2, 4, and CFG-parallel: the prefix K/V cache per rank is the decode graph's k and v inputs
    (made by the graph maker itself, on meta) for each CFG branch the rank runs, and the run figure holds it."""
    from qic import family
    from qic.models.qwen_image_21.graphs import DECODE, denoiser_graph
    from qic.models.qwen_image_21.looped import LoopedQwenImage21Denoiser
    flags = ["plan", "--model", str(REAL_21), "--tp", str(tp), "--resolution", f"{res}x{res}", "--text-buckets",
             "256,", "--cache-dir", str(tmp_path)] + (["--cfg-parallel"] if cfg_parallel else [])
    before = family.current()   # qic plan makes the planned family the build's (a global): restored below
    try:
        out = CliRunner().invoke(main, flags)
    finally:
        family.use(before)
    assert out.exit_code == 0, out.output
    spec = parse_spec({"model": str(REAL_21), "tp": tp, "resolutions": [f"{res}x{res}"], "text_buckets": [256],
                       "cache_dir": str(tmp_path), "cfg_parallel": cfg_parallel})
    family.use(spec.family)
    try:
        configs, raw = resolve_configs(spec.model, tmp_path)
        plan = plan_memory(spec, configs, raw, tmp_path)
    finally:
        family.use(before)
    with torch.device("meta"):
        model = LoopedQwenImage21Denoiser(configs["denoiser"], tp_size=tp)
    inputs = dict(denoiser_graph(model, configs["denoiser"], res, res, 256, DECODE, spec.dtype_of("denoiser")).inputs)
    branch = sum(inputs[n].numel() * inputs[n].element_size() for n in ("k", "v"))
    [(what, kv)] = plan.resident
    assert kv == branch * (1 if cfg_parallel else 2) and "prefix K/V cache" in what, (what, kv)
    assert f"resident between graph calls: {what}" in out.output
    without = dataclasses.replace(plan, resident=[])
    assert plan.run_peak_per_rank - without.run_peak_per_rank == kv


def test_real_weight_bytes_match_the_published_sizes():
    """The configs' README: transformer about 20.4B parameters; the text encoder's language model (what
    qic loads; the vision tower is not read) about 7.1B of its 8.3B."""
    configs, _ = resolve_configs(str(REAL), ROOT)
    dn = weight_bytes("denoiser", configs["denoiser"], 1, "bfloat16") / 2
    te = weight_bytes("text_encoder", configs["text_encoder"], 1, "bfloat16") / 2
    assert 20.3e9 < dn < 20.5e9 and 7.0e9 < te < 7.2e9, (dn, te)
    for tp in (2, 4):  # per-rank bytes, the plan's own account (the shard-file test is in test_tp.py)
        assert weight_bytes("denoiser", configs["denoiser"], tp, "bfloat16") / 2 <= 1.05 * dn / tp


# Shapes large enough that each graph's peak is well above the kernel's resident-set counter batching
# (tens of pages): the tiny text encoder at its longest bucket, the rest at 256x256.
MEASURED = {
    "tiny": [("text_encoder", {"bucket": 1024}), ("denoiser", {"resolution": [256, 256], "bucket": 128}),
             ("vae_decoder", {"resolution": [256, 256]})],
    "small": [("text_encoder", {"bucket": 512}), ("denoiser", {"resolution": [256, 256], "bucket": 128}),
              ("vae_decoder", {"resolution": [256, 256]})],
}


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_estimates_within_25_percent_of_measured_peaks(name):
    """Estimated peak (weights + inputs + live activations on fake tensors) against the resident-set growth
    of a process running the graph eagerly with real weights (benchmarks.peak). The bound can fail: the
    estimate for a smaller resolution, set against the same measurement, falls far outside it."""
    raw = preset(name)
    configs = {n: c.parse_config(raw[c.folder]) for n, c in COMPONENTS.items()}

    def estimate(comp, shape):
        inputs, largest, act, _ = estimate_graph(comp, configs, 1, "float32", shape)
        assert largest <= act
        return weight_bytes(comp, configs[comp], 1, "float32") + inputs + act, act

    for (comp, shape), m in zip(MEASURED[name], measure(name, MEASURED[name])):
        est, act = estimate(comp, shape)
        print(f"{name} {m['graph']}: estimated {est / 1e6:.2f} MB, measured {m['peak'] / 1e6:.2f} MB "
              f"(activations {act / 1e6:.2f} vs {m['activations'] / 1e6:.2f} MB)")
        assert 0.75 <= est / m["peak"] <= 1.25, (name, m, est)
        assert m["activations"] > 1e6  # a graph the measurement can resolve
        if comp == "vae_decoder":
            wrong, _ = estimate(comp, {"resolution": [64, 64]})
            assert not 0.75 <= wrong / m["peak"] <= 1.25, (wrong, m)


def test_compile_estimate_from_cache_records(tmp_path):
    """FAKE cache records (meta.json files written by this test, no compiled code): the plan takes each
    component's median compile time from them, a memoised graph counts as cached, and components without
    records fall back to the documented default."""
    spec = parse_spec({"resolutions": ["48x80"], "text_buckets": [128], "cache_dir": str(tmp_path)})
    configs, raw = resolve_configs(None, tmp_path)
    for i, secs in enumerate((10.0, 30.0, 20.0)):
        d = tmp_path / "graphs" / f"fake{i}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"component": "denoiser", "compile_seconds": secs,
                                                 "backend": {"backend": "inductor"},
                                                 "files": {"graph.pt2": {"bytes": 1000 * (i + 1)}}}))
    # Another back end's record in the same cache is no record of this build's compile time.
    (tmp_path / "graphs" / "fake-export").mkdir()
    (tmp_path / "graphs" / "fake-export" / "meta.json").write_text(json.dumps({
        "component": "denoiser", "compile_seconds": 0.5, "backend": {"backend": "export"},
        "files": {"graph.pt2": {"bytes": 10}}}))
    plan = plan_memory(spec, configs, raw, tmp_path)
    by = {g.component: g for g in plan.graphs}
    assert by["denoiser"].compile_seconds == 20.0 and by["denoiser"].artifact_bytes == 2000
    assert by["text_encoder"].compile_seconds == DEFAULT_COMPILE_SECONDS and not by["text_encoder"].cached
    # An export build plans by its own records, and without any by its back end's own assumption.
    exported = plan_memory(with_changes(spec, backend="export"), configs, raw, tmp_path)
    by = {g.component: g for g in exported.graphs}
    assert by["denoiser"].compile_seconds == 0.5 and by["text_encoder"].compile_seconds == 1.0
    # Memoise the text encoder's graph as a build would (spec key -> graph key -> meta.json).
    from qic.builder.memplan import _spec_keys
    skey = _spec_keys(spec, configs, raw)["text_encoder@L128"]
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / skey).write_text("fake0")
    plan = plan_memory(spec, configs, raw, tmp_path)
    te = next(g for g in plan.graphs if g.component == "text_encoder")
    assert te.cached and te.compile_seconds == 0.0


def test_plan_after_a_build_shows_that_builds_graphs_cached(bundle, tiny_ckpt, cache_dir):
    """The real keys, as the build wrote them: the session bundle's build, then `qic plan` with its flags.
    A resolution no test builds is planned alongside: it must not show as cached."""
    proc = qic("plan", "--model", tiny_ckpt, "--cache-dir", cache_dir, "--resolution", "{}x{}".format(*TINY_RES),
               "--resolution", "96x96", "--text-buckets", ",".join(map(str, BUCKETS)))
    rows = {line.split()[1]: line for line in proc.stdout.splitlines() if "@" in line and line.startswith("│")}
    built = [n for n in rows if "96x96" not in n]
    assert len(built) == 2 + 2 + 1, rows   # text encoder per bucket, denoiser per bucket, VAE decoder
    assert all(rows[n].rstrip(" │").endswith("cached") for n in built), proc.stdout
    assert not any(rows[n].rstrip(" │").endswith("cached") for n in rows if "96x96" in n), proc.stdout


def test_build_prints_the_plan_before_any_work(tmp_path):
    """`qic build` computes the plan once the spec is validated, before stage 1 (stopped here, so nothing
    is compiled)."""
    from qic.builder.pipeline import build

    class Stop(Exception):
        pass

    seen = []

    def on_plan(plan):
        seen.append(plan)
        raise Stop

    spec = parse_spec({"cache_dir": str(tmp_path / "cache"), "output": str(tmp_path / "out"), "tp": 2,
                       "text_buckets": [128]})
    with pytest.raises(Stop):
        build(spec, on_plan=on_plan)
    assert not (tmp_path / "cache" / "shards").exists() and not (tmp_path / "out").exists()
    (plan,) = seen
    assert [c.ranks for c in plan.components] == [2, 2, 1]
    assert re.fullmatch(r"denoiser@128x128@L128", plan.graphs[1].name)   # the default model's first resolution


@pytest.mark.parametrize("split", [(1, 0), (1, 1)], ids=["F1B0", "F1B1"])
def test_plan_flops_of_the_step_and_its_cache_parts_equal_a_count_of_the_eager_graphs(split, tmp_path):
    """`qic plan --step-cache`: each denoiser graph's FLOPs (the whole step, head, rest, mixed@R1, tail) against
    torch's FLOP counter over the same graph run eagerly at the real depth on real weights (the tiny preset,
    3 blocks). FLOPs follow from shapes alone, so the two are equal exactly: the plan's come from fake tensors at
    fewer layers, extrapolated linearly. It can fail: the middle counted at one block fewer (what the plan gave
    when it ran one layer, where the middle had none; with F1B1 it has none at one block fewer) differs."""
    from torch.utils.flop_counter import FlopCounterMode

    from qic.builder.jobs import graph_shapes, make_graph, name_of
    spec = parse_spec({"model": "embedded:tiny", "resolutions": ["48x80"], "text_buckets": [128],
                       "components": ["denoiser", "vae_decoder"], "step_cache": list(split)})
    configs, raw = resolve_configs(spec.model, tmp_path)
    plan = {g.name: g.flops for g in plan_memory(spec, configs, raw, None).graphs if g.component == "denoiser"}

    def count(shape: dict, layers: int) -> int:
        cfgs = {**configs, "denoiser": dataclasses.replace(configs["denoiser"], num_layers=layers)}
        torch.manual_seed(0)
        gdef = make_graph("denoiser", COMPONENTS["denoiser"].make_module(cfgs["denoiser"]).eval(), cfgs, shape,
                          "float32")
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            gdef.module(*[t for _, t in gdef.inputs])
        return flops.get_total_flops()

    shapes = {name_of(c, s): s for c, s in graph_shapes(spec) if c == "denoiser"}
    assert {n.removeprefix("denoiser@48x80@L128") for n in shapes} == {"", "@head", "@rest", "@mixed@R1", "@tail"}
    layers = configs["denoiser"].num_layers
    for name, shape in shapes.items():
        assert plan[name] == count(shape, layers), name
    for middle in ("denoiser@48x80@L128@rest", "denoiser@48x80@L128@mixed@R1"):   # both run the middle blocks
        assert plan[middle] > 0 and plan[middle] != count(shapes[middle], layers - 1), middle


def test_plan_memos_give_the_computed_plan_and_recompute_what_an_input_changes(tmp_path, monkeypatch):
    """A build prints its plan every time; plan_memory keeps each graph's estimate, each component's weight bytes
    and each resolution's step traffic in the cache (plan/). A second plan computes none of them and equals the
    first (the memo returns what was computed); each input a figure depends on recomputes exactly that figure
    (a key missing an input would serve a stale figure: these counts would be zero)."""
    from collections import Counter
    from dataclasses import replace

    from qic.builder import jobs, memplan
    spec = parse_spec({"resolutions": ["48x80"], "text_buckets": [128], "cache_dir": str(tmp_path)})
    configs, raw = resolve_configs(None, tmp_path)
    calls = Counter()
    for fn in ("estimate_graph", "weight_bytes", "step_traffic"):
        real = getattr(memplan, fn)
        # counted by function and component (step_traffic's first argument is the configs: by function only)
        monkeypatch.setattr(memplan, fn, lambda *a, real=real, fn=fn, **k: (
            calls.update([f"{fn} {a[0]}" if isinstance(a[0], str) else fn]), real(*a, **k))[1])

    def plan(s=spec, c=configs, r=raw, cache=tmp_path):
        calls.clear()
        return plan_memory(s, c, r, cache)

    first = plan()
    # TP 1's weight bytes besides the looped form's (the VAE has no looped form: the same memo twice)
    everything = {"weight_bytes text_encoder": 2, "weight_bytes denoiser": 2, "weight_bytes vae_decoder": 1,
                  **{f"estimate_graph {c}": 1 for c in spec.components}, "step_traffic": 1}
    assert calls == everything, calls
    assert plan() == first and not calls
    # The same graphs built by another back end have the same figures: nothing is computed again.
    assert [g.activation_peak for g in plan(replace(spec, backend="export")).graphs] == [
        g.activation_peak for g in first.graphs] and not calls
    # The denoiser's dtype: its weights, its graph's estimate and the step's traffic; the others are kept.
    bf16 = replace(spec, dtype=tuple((c, "bfloat16" if c == "denoiser" else d) for c, d in spec.dtype))
    assert plan(bf16) != first and calls == {"weight_bytes denoiser": 2, "estimate_graph denoiser": 1,
                                             "step_traffic": 1}, calls
    # Another resolution: that resolution's graphs and traffic, no weights.
    plan(replace(spec, resolutions=((48, 80), (80, 48))))
    assert calls == {"estimate_graph denoiser": 1, "estimate_graph vae_decoder": 1, "step_traffic": 1}
    # The denoiser's config: everything that reads it (the traffic reads every config).
    raw2 = {**raw, "transformer": {**raw["transformer"], "num_layers": raw["transformer"]["num_layers"] + 1}}
    configs2 = {n: COMPONENTS[n].parse_config(raw2[COMPONENTS[n].folder]) for n in COMPONENTS}
    plan(c=configs2, r=raw2)
    assert calls == {"weight_bytes denoiser": 2, "estimate_graph denoiser": 1, "step_traffic": 1}
    # qic's graph-shaping code, and the planner's own code (or torch): everything.
    monkeypatch.setattr(jobs, "code_digest", lambda: "edited")
    monkeypatch.setattr(memplan, "code_digest", lambda: "edited")
    assert plan() == first and calls == everything
    monkeypatch.setattr(memplan, "planner_digest", lambda: "edited")
    assert plan() == first and calls == everything
    # A damaged memo is recomputed (and rewritten); without a cache directory nothing is kept or written.
    for p in (tmp_path / "plan").iterdir():
        p.write_text("{not json")
    assert plan() == first and calls == everything
    assert plan() == first and not calls
    assert plan(cache=tmp_path / "absent") == first and not (tmp_path / "absent").exists()
    unkept = everything | {"weight_bytes vae_decoder": 2}   # the VAE's second call is no longer a memo hit
    assert calls == unkept, calls
    # A cache it cannot write to (read-only): the plan is still computed, not failed.
    def read_only(*a, **k):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(memplan, "write_json_atomic", read_only)
    monkeypatch.setattr(memplan, "planner_digest", lambda: "edited again")
    assert plan() == first and calls == unkept, calls


def test_a_first_build_makes_its_cache_for_the_plan_memos(tiny_ckpt, tmp_path):
    """A first build into a cache directory that does not exist yet (a checkpoint elsewhere: nothing else makes
    it before the plan) memoises its plan, so the second build's plan is read, not computed. Stopped at the
    plan: nothing is compiled."""
    from qic.builder.pipeline import build

    class Stop(Exception):
        pass

    def stop(plan):
        raise Stop

    cache = tmp_path / "cache"
    spec = parse_spec({"model": str(tiny_ckpt), "cache_dir": str(cache), "output": str(tmp_path / "out"),
                       "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": [128]})
    with pytest.raises(Stop):
        build(spec, on_plan=stop)
    assert len(list((cache / "plan").glob("traffic-*.json"))) == 1 and len(list((cache / "plan").glob("*"))) > 1


def test_compile_estimate_on_workers_spreads_the_uncached_graphs():
    """The plan's estimate on compile workers: each uncached graph, the longest first, to the worker free soonest;
    a cached graph (0 s) is none's. A TP or parallel-layout build, whose graphs hold collectives and compile in the
    build process, and a back end without workers are planned as one worker."""
    from qic.builder.memplan import GraphPlan, MemoryPlan
    from qic.builder.workers import plan_workers
    from qic.spec import load_spec

    plan = MemoryPlan(1, graphs=[GraphPlan(f"g{i}", "denoiser", 0, 0, 0, 0, 0, s, s == 0, 0)
                                 for i, s in enumerate((20.0, 30.0, 0.0, 10.0, 20.0))])
    assert plan.compile_seconds == 80.0 and plan.compile_wall(1) == 80.0
    assert plan.compile_wall(2) == 40.0 and plan.compile_wall(4) == 30.0
    assert plan_workers(load_spec(None, {}), 3) == 3
    assert plan_workers(load_spec(None, {"tp": 2}), 3) == 1
    assert plan_workers(load_spec(None, {"backend": "export"}), 3) == 1
