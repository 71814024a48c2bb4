"""The bad-input sweep (issue 19): generated build configs, `qic run` options and prompts-file lines, and HTTP
request bodies, of wrong types, huge and empty values, unknown keys, non-UTF-8 bytes, NaN/inf, negative and
huge integers; the run flags, prompt lines and request bodies draw step caching's settings too (--cache-*,
cache_*). Each is either accepted (and then checked the way the verb would go on to use it) or
refused with one line (ConfigError / exit 2 / a 4xx); never a traceback, never a 5xx, and no cache or
bundle file changes. Each sweep must have accepted some examples (a sweep that refuses everything checks only
the refusals). Counts are printed (run with -s to see them).

Examples are derandomized so CI sees the same ones every run; the sizes keep the module under ~2 minutes
on two cores.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qic.errors import QicError
from qic.host.options import CACHE_FIELDS
from qic.spec import KEYS, load_spec
from tests.conftest import TINY_RES, qic, xdist_worker

SWEEP = settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
COUNTS: dict[str, Counter] = {}

# Values of every kind YAML and JSON can carry, biased to the edges the issue lists.
_EDGE_INTS = st.sampled_from([0, 1, -1, 2, 3, 4, 2**31, 2**63, 2**64, -(2**63), 10**30])
_EDGE_FLOATS = st.sampled_from([0.0, -0.0, 0.5, 1.0, 4.0, 72.5, 1e308, -1e308, math.inf, -math.inf, math.nan])
_EDGE_STRS = st.sampled_from(["", " ", "false", "true", "no", "0", "1", "2", "48x80", "16:9", "x" * 5000, "\x00",
                              "a,b", "72,128", "embedded", "float32", "looped", "inductor", "cpu", "-1"])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), _EDGE_INTS, st.floats(), _EDGE_FLOATS,
                     st.text(max_size=30),
                     _EDGE_STRS)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8) | _EDGE_STRS, inner,
                                                                         max_size=4)), max_leaves=8)


def _count(kind: str, outcome: str) -> None:
    COUNTS.setdefault(kind, Counter())[outcome] += 1


def _files(*roots) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for r in roots for p in Path(r).rglob("*") if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def report_counts(bundle, cache_dir):
    """Prints the counts, checks that each sweep that ran accepted some examples, and that the sweeps left the
    session's bundle and cache as they were."""
    before = _files(bundle, cache_dir)
    yield
    after = _files(bundle, cache_dir)
    if xdist_worker():
        # The cache is shared with the other worker, whose builds add entries meanwhile and whose cache hits
        # touch the entries' last-use times (a graph's `done`, a shard's meta.json: prune's LRU order). Here
        # the cache check is that nothing that was there went away or changed size; the bundle, which no test
        # writes, is checked whole.
        def cache_view(files):
            return {k: v[0] for k, v in files.items() if k.startswith(str(cache_dir)) and k in before}
        def bundle_view(files):
            return {k: v for k, v in files.items() if not k.startswith(str(cache_dir))}
        assert bundle_view(after) == bundle_view(before)
        assert cache_view(after) == cache_view(before)
    else:
        assert after == before
    for kind, c in sorted(COUNTS.items()):
        print(f"\nbad-input sweep, {kind}: {sum(c.values())} examples, " + ", ".join(f"{k} {v}" for k, v in
                                                                                      sorted(c.items())))
    none_accepted = [kind for kind, c in COUNTS.items() if not c[ACCEPTED[kind]]]
    assert not none_accepted, f"sweeps that accepted no example: {none_accepted} ({COUNTS})"


# The outcome that counts as accepted, per sweep: an example the verb went on to use.
ACCEPTED = {"build configs": "accepted and valid", "run options": "accepted", "HTTP bodies": "200",
            # the step-cached bundle's sweep must have taken some active step-caching settings, not only refused them
            "run options, step-cached bundle": "accepted with step caching on"}

# Step caching's settings (qic.host.cache_policy): numbers at and around their limits, step masks good and bad.
_CACHE_VALUES = st.one_of(_VALUES, st.integers(-2, 6), st.floats(-1, 3), st.sampled_from(
    ["0-3,5", "0", "3-1", "a-b", "0-100001", ",", [0, 1, 2], [-1], [True], "1e3", "0.5"]))
_CACHE_KEYS = CACHE_FIELDS   # every step-caching row of qic.host.options


# ---- build configs -----------------------------------------------------------------------------------

_CONFIG_VALUES = {"tp": st.one_of(st.integers(-2, 5), _VALUES), "resolutions": st.one_of(
    st.lists(st.sampled_from(["48x80", "16x16", "0x16", "15x16", "16:9", "1:1", "48X80", "x", "99999x99999"]),
             max_size=3), _VALUES),
    "text_buckets": st.one_of(st.lists(st.integers(-5, 2000), max_size=3), _VALUES),
    "components": st.one_of(st.lists(st.sampled_from(["text_encoder", "denoiser", "vae_decoder", "vae"]), max_size=3),
                            _VALUES)}


@st.composite
def _build_configs(draw):
    keys = draw(st.lists(st.sampled_from([*KEYS, "unknown_key", "resolution"]), max_size=5, unique=True))
    return {k: draw(_CONFIG_VALUES.get(k, _VALUES)) for k in keys if k not in ("model", "cache_dir", "output",
                                                                                 "cache_from")}


def _as_yaml(raw: dict) -> bytes:
    """JSON is YAML; NaN and infinities in YAML's own spelling (JSON has none)."""
    text = json.dumps(raw, allow_nan=True)
    return text.replace("-Infinity", "-.inf").replace("Infinity", ".inf").replace("NaN", ".nan").encode()


@pytest.fixture(scope="module")
def validation(tmp_path_factory, cache_dir, tiny_ckpt):
    """What `qic build` checks after parsing, before it writes anything: Context + validate on the tiny
    checkpoint, with every path the sweep's configs may name pinned inside a scratch directory."""
    from qic.builder.context import Context, validate
    from qic.spec import with_changes
    scratch = tmp_path_factory.mktemp("sweep")

    def check(spec):
        spec = with_changes(spec, model=str(tiny_ckpt), cache_dir=str(scratch / "cache"),
                            output=str(scratch / "out"), cache_from=None)
        validate(spec, Context(spec, None))
    return check, scratch


@SWEEP
@given(raw=_build_configs(), garbage=st.one_of(st.none(), st.binary(max_size=40)))
def test_generated_build_configs_are_accepted_or_refused_in_one_line(raw, garbage, tmp_path_factory, validation):
    check, scratch = validation
    cfg = tmp_path_factory.getbasetemp() / "sweep-config.yaml"
    cfg.write_bytes(garbage if garbage is not None and garbage[:1] not in (b"{", b"") else _as_yaml(raw))
    try:
        spec = load_spec(cfg)
    except QicError as e:
        assert "\n" not in e.message and e.message, e.message
        _count("build configs", "refused")
        return
    try:
        check(spec)
    except QicError as e:
        assert "\n" not in e.message, e.message
        _count("build configs", "accepted, then refused by validation")
        return
    _count("build configs", "accepted and valid")
    assert not (scratch / "out").exists()   # checking writes no bundle


# ---- `qic run`: flags and prompts-file lines --------------------------------------------------------

class _Validated(BaseException):
    """Raised by the stand-in for generate(): the request passed every check generate() makes first. A
    BaseException, so that neither the CLI's error path nor click's runner takes it for a failure."""


@pytest.fixture(scope="module")
def loaded(bundle):
    from qic.runtime.bundle import Bundle
    return Bundle(bundle)


_RUN_KEYS = ("prompt", "negative_prompt", "steps", "guidance", "seed", "height", "width", "aspect", "output",
             "unknown", "tp", *_CACHE_KEYS)
_LINE_VALUES = st.one_of(_VALUES, st.integers(-3, 30), st.sampled_from(list(TINY_RES) + ["16:9", "5:3", "0:1"]),
                         _CACHE_VALUES)


@st.composite
def _prompt_lines(draw):
    if draw(st.booleans()):
        return draw(st.binary(max_size=30)) + b"\n"
    obj = {k: draw(_LINE_VALUES) for k in draw(st.lists(st.sampled_from(_RUN_KEYS), max_size=5, unique=True))}
    if draw(st.booleans()):
        obj["prompt"] = draw(st.text(max_size=40) | _EDGE_STRS)
    return json.dumps(obj, allow_nan=True).encode() + b"\n"


_FLAGS = st.lists(st.tuples(st.sampled_from(["--steps", "--guidance", "--seed", "--height", "--width", "--aspect",
                                             "--negative-prompt", "--tp", "--device", "--unknown",
                                             *("--" + k.replace("_", "-") for k in _CACHE_KEYS)]),
                            st.one_of(st.integers(-3, 2**64).map(str), _EDGE_STRS, st.text(max_size=10),
                                      st.sampled_from(["nan", "inf", "-inf", "1e309", "4", "0.5", "48", "80", "0-3,5",
                                                       "3-1", "a-b", "-2"]))),
                  max_size=4)


@pytest.fixture(scope="module")
def cached_bundle(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with FirstBlockCache's split (1, 0), so that step caching's settings can be accepted
    (the session bundle has none: every active setting is refused there). Built with the export back end: the
    sweep checks admission, never the graphs, and this build compiles nothing (seconds)."""
    out = tmp_path_factory.mktemp("sweep-cached") / "bundle"
    qic("build", "--model", tiny_ckpt, "--backend", "export", "--resolution", "{}x{}".format(*TINY_RES),
        "--text-buckets", "72", "--step-cache", "1,0", "--cache-dir", out.parent / "cache", "--output", out)
    return out


@pytest.fixture(scope="module")
def cached_loaded(cached_bundle):
    from qic.runtime.bundle import Bundle
    return Bundle(cached_bundle)


@SWEEP
@given(flags=_FLAGS, lines=st.lists(_prompt_lines(), max_size=3), use_file=st.booleans())
def test_generated_run_options_are_accepted_or_refused_in_one_line(flags, lines, use_file, bundle, loaded,
                                                                    tmp_path_factory, monkeypatch):
    _sweep_run_options("run options", flags, lines, use_file, bundle, loaded, tmp_path_factory, monkeypatch)


@settings(SWEEP, max_examples=400)
@given(flags=_FLAGS, lines=st.lists(_prompt_lines(), max_size=3), use_file=st.booleans())
def test_generated_run_options_on_a_step_cached_bundle(flags, lines, use_file, cached_bundle, cached_loaded,
                                                       tmp_path_factory, monkeypatch):
    _sweep_run_options("run options, step-cached bundle", flags, lines, use_file, cached_bundle, cached_loaded,
                       tmp_path_factory, monkeypatch)


def _sweep_run_options(kind, flags, lines, use_file, bundle, loaded, tmp_path_factory, monkeypatch):
    import qic.cli.run as run_verb
    from qic.cli import main
    from qic.runtime.generate import validate
    from qic.runtime.programs import program_of

    def checked(b, req):
        req = validate(req, loaded)
        assert (req.height, req.width) in loaded.resolutions
        if req.cache.active:   # only a bundle with step-caching graphs takes an active setting
            assert loaded.step_cache, req.cache
            _count(kind, "accepted with step caching on")
        raise _Validated
    def load(*args, **kwargs):
        return loaded
    load.seconds_loading = 0.0   # what run's load clock reads of the Bundle class
    monkeypatch.setattr(run_verb, "Bundle", load)
    monkeypatch.setattr(program_of(loaded.manifest), "generate", checked)   # the bundle's host program's
    args = ["run", str(bundle)]
    if use_file:
        prompts = tmp_path_factory.getbasetemp() / "sweep-prompts.jsonl"
        prompts.write_bytes(b"".join(lines))
        args += ["--prompts-file", str(prompts)]
    else:
        args += ["--prompt", "a red bicycle"]
    for flag, value in flags:
        args += [flag, value]
    try:
        result = CliRunner().invoke(main, args)
    except _Validated:
        _count(kind, "accepted")
        return
    assert result.exit_code == 2, (args, result.output, result.exc_info)
    assert "Traceback" not in result.output
    first = result.output.strip().splitlines()[0]
    assert first.startswith(("error: ", "Usage: ", "Error: ")), result.output
    assert "internal error" not in result.output, (args, result.output)
    _count(kind, "refused")


# ---- HTTP request bodies ---------------------------------------------------------------------------

class _PlanOnly:
    """A STAND-IN runner: the real BundleRunner's checks of each request against the loaded bundle, and
    a marker instead of an image (the sweep checks admission; images are test_serve's)."""

    def __init__(self, bundle):
        from qic.serve.runner import BundleRunner
        self.real = BundleRunner(bundle)
        self.model_id, self.created, self.sizes = self.real.model_id, self.real.created, self.real.sizes
        self.batch_sizes, self.program = self.real.batch_sizes, self.real.program

    def plan(self, req):
        return self.real.plan(req)

    def run(self, reqs):
        return [b"image" for _ in reqs]


@pytest.fixture(scope="module")
def http_server(loaded):
    from tests.test_serve import ThreadServer
    with ThreadServer(_PlanOnly(loaded), queue=64, max_n=4) as server:
        yield server


_HTTP_KEYS = ("prompt", "n", "size", "response_format", "model", "user", "seed", "steps", "guidance",
              "negative_prompt", "extra", "quality", *_CACHE_KEYS)


@st.composite
def _http_bodies(draw):
    kind = draw(st.sampled_from(["object", "object", "object", "bytes", "json"]))
    if kind == "bytes":
        return draw(st.binary(max_size=60))
    if kind == "json":
        return json.dumps(draw(_VALUES), allow_nan=True).encode()
    obj = {k: draw(_CACHE_VALUES if k in _CACHE_KEYS else st.one_of(
        _VALUES, st.integers(-2, 6), st.sampled_from(["{1}x{0}".format(*TINY_RES), "auto"])))
           for k in draw(st.lists(st.sampled_from(_HTTP_KEYS), max_size=6, unique=True))}
    if draw(st.booleans()):
        obj["prompt"] = draw(st.text(max_size=40) | _EDGE_STRS)
    return json.dumps(obj, allow_nan=True).encode()


@SWEEP
@given(body=_http_bodies())
def test_generated_http_bodies_get_an_image_or_a_4xx(body, http_server):
    from qic.serve.client import request
    status, _, reply = request(http_server.port, "POST", "/v1/images/generations", raw=body)
    assert status < 500, (body, status, reply)
    if status == 200:
        _count("HTTP bodies", "200")
        return
    assert reply and reply["error"]["message"] and "\n" not in reply["error"]["message"], reply
    _count("HTTP bodies", str(status))
