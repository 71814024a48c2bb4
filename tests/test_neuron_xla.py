"""The neuron back end's lowering half, run for real: torch-xla in .venv-xla (`make xla-env`).

Every graph lowers to an HloModuleProto, executes on XLA:CPU and matches eager PyTorch; the image made
through the lowered graphs matches the inductor bundle's, at TP 1 and TP 2 (rank 0's two XLA:CPU devices
running both ranks' graphs); a TP build checks every rank's graph on as many XLA:CPU devices against eager
at as many ranks, and that check can fail; TP graphs hold explicit all-reduces over the TP ranks and, run
on as many XLA:CPU devices, equal TP 1; the looped graphs stay depth-independent; the
real Qwen-Image configs lower far below the 2 GB protobuf limit. neuronx-cc and libnrt are not here:
their halves are tested against fakes in test_neuron_cc_fake.py / test_neuron_loader_fake.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests import zygote_client as zygote
from tests.conftest import BUCKETS, ROOT, SHORT_PROMPT, TINY_RES, image_diff, qic
from tests.helpers import MAX_PIXEL, MEAN_PIXEL

pytestmark = pytest.mark.slow   # lowers graphs with torch-xla and runs them on XLA:CPU

XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
XLA_CPU_REL_L2 = 1e-5   # qic.backends.neuron.build.XLA_CPU_REL_L2 (fp32, a few ulps per reduction; see there)
TP_MAX_ABS_REL = 1e-4   # TP vs TP 1 on XLA:CPU, max-abs over the output's max magnitude (why: the TP HLO test)


def xla(*args, env=None, check=True, timeout=900) -> subprocess.CompletedProcess:
    """Run `python ARGS` in the lowering environment (its own torch 2.9 + torch-xla 2.9)."""
    if not XLA_PYTHON.is_file():
        pytest.fail(f"{XLA_PYTHON} is missing: `make test` creates it (`make xla-env`)")
    argv, overrides = [str(XLA_PYTHON), *map(str, args)], {"PYTHONPATH": str(ROOT), **(env or {})}
    if zygote.forkable(argv, overrides, timeout=timeout):   # a fork of a zygote of that python (tests/zygote.py)
        proc = zygote.run(argv, {**os.environ, **overrides}, ROOT, timeout)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **overrides},
                              timeout=timeout)
    if check and proc.returncode != 0:
        command = " ".join(map(str, args))
        raise AssertionError(f"{command} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


def xla_qic(*args, **kw) -> subprocess.CompletedProcess:
    return xla("-m", "qic.cli", *args, **kw)


@pytest.fixture(scope="session")
def neuron_bundle(workdir, neuron_cache, tiny_ckpt) -> tuple[Path, subprocess.CompletedProcess]:
    out = workdir / "bundle-neuron"
    proc = xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", neuron_cache,
                   "--output", out, "--resolution", "{}x{}".format(*TINY_RES),
                   "--text-buckets", ",".join(map(str, BUCKETS)))
    return out, proc


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_build_lowers_every_graph_and_checks_it_on_xla_cpu(neuron_bundle):
    bundle, proc = neuron_bundle
    m = _manifest(bundle)
    assert m["backend"]["backend"] == "neuron" and m["lower_only"] is True
    names = sorted(g["name"] for g in m["graphs"])
    assert names == sorted([f"text_encoder@L{b}" for b in BUCKETS] + [f"denoiser@48x80@L{b}" for b in BUCKETS]
                           + ["vae_decoder@48x80"])
    for g in m["graphs"]:
        rel = g["checks"]["xla_cpu_rel_l2"]
        print(g["name"], "xla_cpu_rel_l2", rel)
        assert rel is not None and 0 <= rel <= XLA_CPU_REL_L2, g["name"]
        assert g["neff"] is None and g["hlo"].endswith("model.hlo_module.pb")
    # Without neuronx-cc: one warning line, exit 0 (checked by xla_qic), nothing else on stderr.
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "neuronx-cc" in warnings[0] and "lower-only" in warnings[0], proc.stdout


def test_inspect_shows_lower_only_and_the_check_figures(neuron_bundle):
    bundle, _ = neuron_bundle
    out = xla_qic("inspect", bundle).stdout
    assert "lower-only" in out
    m = _manifest(bundle)
    for g in m["graphs"]:
        assert f"{g['checks']['xla_cpu_rel_l2']:.2g}" in out


def test_lower_only_bundle_refuses_the_neuron_device_in_one_line(neuron_bundle):
    bundle, _ = neuron_bundle
    proc = xla_qic("run", bundle, "--prompt", SHORT_PROMPT, "--steps", "2", "--output", bundle.parent / "no.png",
                   check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and "lower-only" in proc.stderr and len(proc.stderr.splitlines()) == 2


def test_image_through_lowered_graphs_matches_inductor_bundle(neuron_bundle, bundle, workdir):
    """Same checkpoint, prompt, seed and steps: the neuron bundle run on XLA:CPU vs the inductor bundle."""
    _draws_like_inductor(neuron_bundle[0], bundle, workdir, "tp1")


def test_a_weight_set_runs_on_the_lowered_graphs(neuron_bundle, bundle, workdir, tmp_path):
    """qic build --weights-for a neuron bundle (a checkpoint of the same architecture, other weights) and qic run
    --device xla-cpu --weights SET: the neuron back end takes its weights at load (no rebind), so the lowered graphs
    load over the set's; the image is the inductor bundle's over a set cut from the same checkpoint (the bound of
    _draws_like_inductor), and not the neuron bundle's own."""
    from qic.checkpoint.embedded import write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1)
    common = ["--prompt", SHORT_PROMPT, "--steps", "4", "--seed", "3"]
    xla_qic("build", "--weights-for", neuron_bundle[0], "--model", ckpt, "--output", tmp_path / "set-neuron",
            "--cache-dir", tmp_path / "cache-xla")   # its own torch: its own shard cache
    xla_qic("run", neuron_bundle[0], "--device", "xla-cpu", "--weights", tmp_path / "set-neuron", *common,
            "--output", tmp_path / "xla.png")
    qic("build", "--weights-for", bundle, "--model", ckpt, "--output", tmp_path / "set", "--cache-dir",
        tmp_path / "cache")
    qic("run", bundle, "--weights", tmp_path / "set", *common, "--output", tmp_path / "inductor.png")
    xla_png = Image.open(tmp_path / "xla.png")
    worst, mean = image_diff(xla_png, Image.open(tmp_path / "inductor.png"))
    print(f"weight set: xla-cpu vs inductor: max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    xla_qic("run", neuron_bundle[0], "--device", "xla-cpu", *common, "--output", tmp_path / "own.png")
    assert image_diff(xla_png, Image.open(tmp_path / "own.png"))[0] > 20   # the set's weights ran


_INDUCTOR_PNGS: dict = {}   # (inductor bundle, seed) -> its `qic run` PNG, drawn once a module


def _draws_like_inductor(neuron: Path, inductor: Path, workdir: Path, tag: str, wrong_seed: bool = True) -> None:
    """`qic run --device xla-cpu` on the neuron bundle and `qic run` on the inductor bundle of the same spec
    draw the same image: fp32 graphs on both sides, so the only differences are reassociated sums (~1e-6
    relative), far below one 8-bit level: at most 2/255 anywhere, a mean of 0.02 of a level. The bound can fail
    (wrong_seed): another seed through the inductor bundle is far outside it."""
    def common(seed: int) -> list:
        return ["--prompt", SHORT_PROMPT, "--steps", "4", "--seed", seed]
    xla_png = workdir / f"xla-cpu-{tag}.png"
    xla_qic("run", neuron, "--device", "xla-cpu", *common(3), "--output", xla_png)
    if (inductor, 3) not in _INDUCTOR_PNGS:   # the TP 2 and CFG-parallel neuron bundles meet the same inductor image
        _INDUCTOR_PNGS[inductor, 3] = workdir / f"inductor-{tag}.png"
        qic("run", inductor, *common(3), "--output", _INDUCTOR_PNGS[inductor, 3])
    ind_png = _INDUCTOR_PNGS[inductor, 3]
    worst, mean = image_diff(Image.open(xla_png), Image.open(ind_png))
    print(f"{tag}: xla-cpu vs inductor: max {worst:.0f}/255, mean {mean:.5f} levels")
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    if not wrong_seed:
        return
    other = workdir / f"inductor-{tag}-seed4.png"
    qic("run", inductor, *common(4), "--output", other)
    worst_wrong, _ = image_diff(Image.open(xla_png), Image.open(other))
    assert worst_wrong > 20


@pytest.fixture(scope="session")
def neuron_bundle_tp2(workdir, neuron_cache, tiny_ckpt) -> tuple[Path, subprocess.CompletedProcess]:
    """bundle_tp2's spec (TP 2, bucket 72) on the neuron back end; the VAE graph is neuron_bundle's."""
    out = workdir / "bundle-neuron-tp2"
    proc = xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", neuron_cache,
                   "--output", out, "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "72,", "--tp", "2")
    return out, proc


def test_tp2_build_checks_every_rank_on_as_many_xla_cpu_devices(neuron_bundle_tp2):
    """The graphs with collectives ran at both ranks on two XLA:CPU devices against eager at two ranks; the
    lower-only warning says so, graph by kind, and lists nothing unchecked."""
    bundle, proc = neuron_bundle_tp2
    graphs = {g["name"]: g["checks"] for g in _manifest(bundle)["graphs"]}
    assert {n: c["xla_cpu_ranks"] for n, c in graphs.items()} == {
        "text_encoder@L72": 2, "denoiser@48x80@L72": 2, "vae_decoder@48x80": 1}
    for name, c in graphs.items():
        print(name, c)
        assert 0 <= c["xla_cpu_rel_l2"] <= XLA_CPU_REL_L2 and c["xla_cpu_max_abs"] >= 0, name
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stdout
    assert ("3 of 3 graphs executed on XLA:CPU and matched eager PyTorch (1 on one XLA:CPU device, 2 at 2 ranks "
            "on 2 XLA:CPU devices)") in warnings[0] and "not checked" not in warnings[0], warnings[0]


def test_tp2_neuron_bundle_runs_on_xla_cpu_like_the_inductor_tp2_bundle(neuron_bundle_tp2, bundle_tp2, workdir):
    """`qic run --device xla-cpu` on a TP 2 bundle: two rank processes, rank 0's two XLA:CPU devices running
    both ranks' graphs, the image bundle_tp2 (inductor, TP 2) draws."""
    _draws_like_inductor(neuron_bundle_tp2[0], bundle_tp2, workdir, "tp2")


def test_cfg_parallel_neuron_bundle_runs_on_xla_cpu_like_the_inductor_tp2_bundle(workdir, neuron_cache, tiny_ckpt,
                                                                                  bundle_tp2):
    """A layout other than TP: CFG-parallel 2 (the step's cond and uncond rows on two ranks, an all-gather
    over the CFG axis), checked at build at both ranks, run on two XLA:CPU devices; every layout draws the
    TP 1 image, so the inductor TP 2 bundle's is the reference (the text encoder and VAE are TP 1 graphs,
    cache hits of neuron_bundle's)."""
    out = workdir / "bundle-neuron-cfg2"
    xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", neuron_cache,
            "--output", out, "--resolution", "{}x{}".format(*TINY_RES), "--text-buckets", "72,", "--cfg-parallel")
    ranks = {g["name"]: g["checks"]["xla_cpu_ranks"] for g in _manifest(out)["graphs"]}
    assert ranks == {"text_encoder@L72": 1, "denoiser@48x80@L72": 2, "vae_decoder@48x80": 1}
    _draws_like_inductor(out, bundle_tp2, workdir, "cfg2", wrong_seed=False)


def test_multi_rank_build_check_can_fail():
    """The build's 2-rank check passes the graphs as lowered and fails them lowered with each rank reducing
    alone; and eager without the in-memory collectives (the build's fake group) is far from the HLO."""
    proc = xla("-m", "benchmarks.xla_lowering", "sensitivity-ranks", 2, env={"CPU_NUM_DEVICES": "2"})
    result = json.loads(proc.stdout.splitlines()[-1])
    print(result)
    for component, r in result.items():
        assert r["right"]["ok"] and r["right"]["rel_l2"] <= XLA_CPU_REL_L2, component
        assert not r["reduced_alone"]["ok"], component
        assert r["eager_without_collectives"] > 1e-2, component   # 1000x the bound


def test_second_config_lowers_and_checks(workdir, tiny_alt_ckpt):
    """tiny-alt: other heads, GQA ratio, depth, z_dim and VAE depth; an unrolled build for good measure."""
    out = workdir / "bundle-neuron-alt"
    xla_qic("build", "--backend", "neuron", "--model", tiny_alt_ckpt, "--cache-dir", workdir / "cache-neuron-alt",
            "--output", out, "--resolution", "40x24", "--text-buckets", "128,", "--layers", "unrolled")
    for g in _manifest(out)["graphs"]:
        assert 0 <= g["checks"]["xla_cpu_rel_l2"] <= XLA_CPU_REL_L2, g


def test_rebuild_lowers_nothing(neuron_bundle, workdir, neuron_cache, tiny_ckpt):
    bundle, _ = neuron_bundle
    proc = xla_qic("build", "--backend", "neuron", "--model", tiny_ckpt, "--cache-dir", neuron_cache,
                   "--output", bundle, "--resolution", "{}x{}".format(*TINY_RES),
                   "--text-buckets", ",".join(map(str, BUCKETS)))
    assert "100% hits" in proc.stdout and "bundle unchanged" in proc.stdout


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_hlo_has_explicit_all_reduces_and_equals_tp1_on_as_many_devices(tp):
    proc = xla("-m", "benchmarks.xla_lowering", "tp", tp, env={"CPU_NUM_DEVICES": str(tp)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for component, r in result.items():
        print(component, r)
        assert r["replica_groups"] == [json.dumps([list(range(tp))])]
        assert r["host_transfers"] == 0 and r["while"] == 1
        # all-reduces: per block one per row-parallel output (denoiser: both streams' attention outputs and
        # MLPs; text encoder: o_proj and down_proj) plus one outside the loop (denoiser: the timestep
        # embedder's row-parallel half; text encoder: the vocab-parallel embedding's sum). All-gathers: the
        # column-parallel modulation and the gathered projections (denoiser only).
        assert r["all_reduce"] == {"denoiser": 5, "text_encoder": 3}[component]
        assert (r["all_gather"] > 0) == (component == "denoiser")
        assert len(r["cos"]) == tp and min(r["cos"]) >= 0.99999
        # TP reorders fp32 sums only (the build's own XLA:CPU bound, a few ulps per reduction), and elementwise,
        # on the output's scale, no worse than one reduction over the tiny widths' <= 256 terms per layer adds up
        # over a few layers: 256 ulps (u = 6e-8) = 1.5e-5 a reduction, TP_MAX_ABS_REL for the chain.
        assert max(r["rel_l2"]) <= XLA_CPU_REL_L2 and max(r["max_abs_rel"]) <= TP_MAX_ABS_REL
        # The comparison can fail: rank 0 on rank 1's shard is far outside both.
        assert r["wrong_shard_cos"] < 0.999 and r["wrong_shard_rel_l2"] > 100 * XLA_CPU_REL_L2


def test_looped_hlo_is_depth_independent_and_real_configs_lower_below_2gb():
    depth = json.loads(xla("-m", "benchmarks.xla_lowering", "depth-sizes").stdout.strip().splitlines()[-1])
    small, deep = depth["looped"]["4"]["hlo_bytes"], depth["looped"]["60"]["hlo_bytes"]
    print("looped HLO bytes at 4 and 60 blocks:", small, deep)
    assert deep <= 1.05 * small
    assert depth["unrolled"]["60"]["hlo_bytes"] > 5 * depth["unrolled"]["4"]["hlo_bytes"]   # the check can fail
    real = json.loads(xla("-m", "benchmarks.xla_lowering", "real", "1024x1024").stdout.strip().splitlines()[-1])
    for name, r in real.items():
        print(name, r)
        assert r["hlo_bytes"] < 50e6   # the protobuf limit is 2 GB; weights are parameters, never inside
    assert real["denoiser@1024x1024@L256"]["while"] == 1


def test_hlo_names_entry_tensors_for_the_neff(neuron_bundle):
    """Parameters named input<i> in order, the root's outputs output<j>: the names the NEFF runner binds by
    (qic.backends.neuron.nrt); read back with qic's own proto reader, no XLA needed."""
    from qic.backends.neuron import hlo_proto
    bundle, _ = neuron_bundle
    m = _manifest(bundle)
    for g in m["graphs"]:
        proto = (bundle / g["hlo"]).read_bytes()
        attrs = hlo_proto.entry_attributes(proto)
        inputs = sorted(int(a["neff_input_names"][5:]) for a in attrs.values() if "neff_input_names" in a)
        params = json.loads((bundle / g["params"]).read_text())["params"]
        assert inputs == list(range(len(params)))
        assert [a["neff_output_names"] for a in attrs.values() if "neff_output_names" in a] == ["output0"]
        # inputs first, then weights, each in the order the runtime holds them
        kinds = [k for k, _ in params]
        assert kinds == sorted(kinds, key=lambda k: k != "input")
        assert [i for k, i in params if k == "weight"] == sorted(i for k, i in params if k == "weight")


def test_xla_cpu_check_bound_can_fail():
    """The build's check (rel-L2 <= 1e-5 against eager) passes with the right inputs and fails when the
    padding mask is dropped or one block's MLP output weights are zeroed."""
    r = json.loads(xla("-m", "benchmarks.xla_lowering", "sensitivity").stdout.strip().splitlines()[-1])
    print(r)
    assert r["right"] <= XLA_CPU_REL_L2
    assert r["mask_dropped"] > 100 * XLA_CPU_REL_L2 and r["block_zeroed"] > 100 * XLA_CPU_REL_L2


def test_bf16_graphs_are_checked_against_fp32(workdir, tiny_ckpt):
    """A bf16 build: XLA and eager round differently, so each is compared with fp32 and XLA's error may be
    at most twice eager's own (qic.backends.neuron.build.NeuronBackend.check); the figures are recorded."""
    config = workdir / "neuron-bf16.yaml"
    config.write_text(json.dumps({"backend": "neuron", "model": str(tiny_ckpt),
                                  "dtype": {"text_encoder": "bfloat16", "denoiser": "bfloat16"},
                                  "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": [128],
                                  "output": str(workdir / "bundle-neuron-bf16"),
                                  "cache_dir": str(workdir / "cache-neuron-bf16")}))
    xla_qic("build", config)
    for g in _manifest(workdir / "bundle-neuron-bf16")["graphs"]:
        c = g["checks"]
        print(g["name"], c)
        if g["component"] == "vae_decoder":   # always fp32
            assert c["xla_cpu_rel_l2"] <= XLA_CPU_REL_L2
        else:
            assert 0 < c["eager_rel_l2_vs_fp32"] and c["xla_cpu_rel_l2_vs_fp32"] <= 2 * c["eager_rel_l2_vs_fp32"] + 1e-5
