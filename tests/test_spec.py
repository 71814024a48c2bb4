"""The build config (qic/spec.py): every key parses by its type and a wrong one is refused naming key, value,
file and line (issue 19's finding 2); text buckets as users read them, resolution presets, scheduler
overrides (issue 10)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qic.errors import ConfigError
from qic.spec import MAX_TEXT_BUCKET, BuildSpec, load_spec, parse_spec


def _spec(tmp_path, yaml_text="", **flags):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    return load_spec(path, flags)


@pytest.mark.parametrize("value,expect", [("128", (128,)), (128, (128,)), ("128,", (128,)), ("72,128", (72, 128)),
                                          ([256, 128], (128, 256)), ("0", (0,)), (0, (0,))])
def test_a_bare_number_is_one_bucket(value, expect):
    assert parse_spec({"text_buckets": value}).text_buckets == expect


def test_a_step_is_its_own_key_and_flag(tmp_path):
    buckets = parse_spec({"text_bucket_step": 64}).text_buckets
    assert buckets[:3] == (64, 128, 192) and buckets[-1] >= MAX_TEXT_BUCKET > buckets[-2]
    # A flag of either form replaces the config's buckets in the other form.
    assert _spec(tmp_path, "text_buckets: [72]\n", text_bucket_step=512).text_buckets == (512, 1024, 1536)
    assert _spec(tmp_path, "text_bucket_step: 64\n", text_buckets="128").text_buckets == (128,)
    with pytest.raises(ConfigError, match="not both"):
        parse_spec({"text_buckets": [128], "text_bucket_step": 64})
    for bad in (0, -64, "x"):
        with pytest.raises(ConfigError, match="text_bucket_step"):
            parse_spec({"text_bucket_step": bad})
    with pytest.raises(ConfigError, match="0 alone"):
        parse_spec({"text_buckets": "0,128"})


def test_resolution_presets_in_flags_and_configs(tmp_path):
    from qic.host.aspect import PRESETS
    assert PRESETS["16:9"] == (928, 1664) and PRESETS["1:1"] == (1328, 1328)  # (height, width)
    assert all(h % 16 == 0 and w % 16 == 0 for h, w in PRESETS.values())
    spec = _spec(tmp_path, 'resolutions: ["16:9", "1104x1472"]\n')
    assert spec.resolutions == ((928, 1664), (1104, 1472))
    assert _spec(tmp_path, resolutions=["2:3", "3:2"]).resolutions == ((1584, 1056), (1056, 1584))
    with pytest.raises(ConfigError, match="'5:4' is not a preset.*16:9 = 928x1664"):
        parse_spec({"resolutions": ["5:4"]})


def test_aspect_picks_a_bundle_resolution():
    from qic.host.aspect import pick_resolution
    built = [(48, 80), (32, 48), (928, 1664), (1328, 1328)]
    assert pick_resolution("16:9", built) == (928, 1664)
    assert pick_resolution("1:1", built) == (1328, 1328)
    assert pick_resolution("5:3", built) == (48, 80)      # any W:H ratio, not only the presets
    assert pick_resolution("3:2", built) == (32, 48)
    assert pick_resolution("16:9", [(512, 912), (928, 1664)]) == (928, 1664)
    assert pick_resolution("16:9", [(512, 912)]) == (512, 912)   # 912/512 = 1.781: the same ratio
    with pytest.raises(ConfigError, match="no resolution of that aspect ratio.*48x80 \\(5:3\\)"):
        pick_resolution("9:16", [(48, 80)])
    with pytest.raises(ConfigError, match="W:H"):
        pick_resolution("wide", built)


def test_scheduler_overrides_are_validated():
    spec = parse_spec({"scheduler": {"base_shift": 1.1, "shift_terminal": None}, "defaults": {"steps": 4}})
    assert dict(spec.scheduler) == {"base_shift": 1.1, "shift_terminal": None} and dict(spec.defaults) == {"steps": 4}
    for bad, expect in (({"base_shfit": 1.0}, "'base_shfit' is not a FlowMatchEulerDiscreteScheduler option"),
                        ({"max_shift": "3"}, "scheduler.max_shift = '3' has the wrong type"),
                        ({"shift_terminal": 1.5}, "shift_terminal must be in"),
                        ({"use_dynamic_shifting": 1}, "use_dynamic_shifting = 1 has the wrong type")):
        with pytest.raises(ConfigError, match=expect):
            parse_spec({"scheduler": bad})
    for bad in ({"steps": 0}, {"guidance": -1}, {"cfg": 1}):
        with pytest.raises(ConfigError, match="defaults"):
            parse_spec({"defaults": bad})
    from qic.checkpoint.presets import QWEN_IMAGE_SCHEDULER
    from qic.host.schedule import merge_scheduler
    with pytest.raises(ConfigError, match="use_karras_sigmas"):
        merge_scheduler(QWEN_IMAGE_SCHEDULER, {"use_karras_sigmas": True})


@pytest.mark.parametrize("steps", [4, 8])
def test_lightning_recipe_schedule_matches_diffusers(steps):
    """configs/lightning.yaml's overrides on the real scheduler config give diffusers' sigmas bit for bit,
    and differ from the default schedule (so the override is real)."""
    import math

    import torch

    from qic.checkpoint.presets import QWEN_IMAGE_SCHEDULER
    from qic.host.schedule import flow_match_schedule, merge_scheduler
    CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
    from tests.test_host import diffusers_schedule

    spec = load_spec(CONFIG_DIR / "lightning.yaml")
    over = dict(spec.scheduler)
    assert over["base_shift"] == over["max_shift"] == pytest.approx(math.log(3)) and over["shift_terminal"] is None
    assert dict(spec.defaults) == {"steps": 8, "guidance": 1.0}
    merged = merge_scheduler(QWEN_IMAGE_SCHEDULER, over)
    for seq_len in (1024, 6889, 6032):  # packed tokens at 512x512, 1328x1328 (1:1), 928x1664 (16:9)
        ref_sigmas, ref_t = diffusers_schedule(merged, steps, seq_len)
        ours = flow_match_schedule(merged, steps, seq_len)
        assert torch.equal(ours.sigmas, ref_sigmas) and torch.equal(ours.timesteps, ref_t)
        default = flow_match_schedule(QWEN_IMAGE_SCHEDULER, steps, seq_len).sigmas
        assert (default - ours.sigmas).abs().max() > 1e-2
        # mu = ln 3 at every length: the time shift is the fixed shift 3.
        plain = torch.linspace(1, 1 / steps, steps)
        assert torch.allclose(ours.sigmas[:-1], 3 * plain / (1 + 2 * plain), atol=1e-6)


def test_lora_flags_and_config_entries():
    spec = parse_spec({"loras": ["a.safetensors", "dir/b.safetensors:0.5", {"file": "c:d.safetensors", "scale": 2}]})
    assert spec.loras == (("a.safetensors", 1.0), ("dir/b.safetensors", 0.5), ("c:d.safetensors", 2.0))
    for bad in ([{"path": "x"}], [{"file": "x", "scale": "big"}]):
        with pytest.raises(ConfigError, match="loras entry|LoRA scale"):
            parse_spec({"loras": bad})
    assert parse_spec({"cfg": [False, True]}).cfg == (True, False)
    assert parse_spec({"defaults": {"guidance": 1.0}}).cfg == (True, False)   # no-CFG defaults: both graphs
    assert parse_spec({}).cfg == (True,)
    with pytest.raises(ConfigError, match="cfg must be"):
        parse_spec({"cfg": "yes"})


def test_the_default_build_needs_no_config_file_and_is_configs_shapes_yaml(tmp_path, monkeypatch):
    """`qic build` with no config reads no file (an installed qic has no configs/ beside it); the
    repository's configs/shapes.yaml spells out the same spec: the trained model at its three resolutions.
    configs/tiny.yaml is the random tiny model at its test shape."""
    from qic.spec import load_spec
    monkeypatch.chdir(tmp_path)
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert load_spec() == load_spec(configs / "shapes.yaml")
    assert load_spec().resolutions == ((128, 128), (96, 160), (160, 96))
    tiny = load_spec(configs / "tiny.yaml")
    assert tiny.model == "embedded:tiny" and tiny.resolutions == ((48, 80),) and tiny.output == "artifacts/tiny"


# ---- issue 19's finding 2: every key parses by type ------------------------------------------------------

_FIELDS = {f.name: f.type for f in dataclasses.fields(BuildSpec)}
# Wrong-typed values per kind of key, as YAML gives them: strings where booleans go ("false" is truthy),
# a bare number where a list goes, floats and booleans where integers go (True == 1 in Python).
_WRONG = {"bool": ['"false"', '"true"', "1", "0", "null", "[true]"],
          "list": ["5", "true", "{a: 1}"],
          "int list": ["2.5", "[72.5]", "true", "[true]", '"x"', "{a: 1}"],   # one integer is the one-item list
          "int": ['"2"', "2.5", "true", "[1]"],
          "str": ["5", "[a]", "true"]}
_LIST_KEYS = ("resolutions", "components", "cache_public_keys", "loras")
_INT_LIST_KEYS = ("text_buckets", "batch_sizes")
_INT_KEYS = ("tp", "lnc", "text_bucket_step", "ulysses")
_STR_KEYS = ("output", "cache_dir", "model", "cache_from", "cpu_target")


def _kind(key: str) -> str | None:
    if _FIELDS.get(key) == "bool":
        return "bool"
    kinds = (("list", _LIST_KEYS), ("int list", _INT_LIST_KEYS), ("int", _INT_KEYS), ("str", _STR_KEYS))
    return next((k for k, keys in kinds if key in keys), None)


def test_the_table_covers_every_boolean_key_of_the_spec():
    # Derived from the dataclass, so a new boolean key is in the table below without anyone adding it.
    assert {k for k, t in _FIELDS.items() if t == "bool"} == {"full_hash", "xla_check", "cache_trusted", "cfg_parallel"}


@pytest.mark.parametrize("key,value", [(k, v) for k in [*_FIELDS, "text_bucket_step"] if _kind(k)
                                       for v in _WRONG[_kind(k)]])
def test_a_wrongly_typed_value_is_refused_naming_key_value_file_and_line(tmp_path, key, value):
    cfg = tmp_path / "build.yaml"
    cfg.write_text(f"backend: inductor\n{key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_spec(cfg)
    assert f"{cfg}:2:" in e.value.message and key in e.value.message, e.value.message


def test_cache_trusted_string_false_does_not_trust(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text('cache_from: /somewhere\ncache_trusted: "false"\n')
    with pytest.raises(ConfigError, match=r"b.yaml:2: cache_trusted must be true or false, got 'false'"):
        load_spec(cfg)
    assert load_spec(None, {"cache_trusted": True}).cache_trusted is True   # the flag's form still works


def test_right_types_still_parse_and_flags_keep_their_comma_form():
    spec = parse_spec({"full_hash": True, "xla_check": False, "components": "denoiser,vae_decoder",
                       "text_buckets": "72,128", "batch_sizes": "1,2", "tp": 2, "lnc": 2, "output": "o"})
    assert (spec.full_hash, spec.xla_check, spec.components, spec.text_buckets, spec.batch_sizes) == \
        (True, False, ("denoiser", "vae_decoder"), (72, 128), (1, 2))


@pytest.mark.parametrize("raw,needle", [
    ({"text_buckets": [72.5]}, "text_buckets"), ({"output": None}, "output"), ({"components": 5}, "components"),
    ({"resolutions": 512}, "resolutions"), ({"scheduler": {"shift": float("nan")}}, "scheduler.shift"),
    ({"loras": [{"file": "x", "scale": float("inf")}]}, "LoRA scale"), ({"lnc": True}, "lnc"),
    ({"text_buckets": [10**30]}, "text_buckets")])
def test_values_that_were_silently_bent_are_refused(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_spec(raw)


def test_yaml_errors_keep_their_line(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text("tp: 1\nresolutions: [48x80\ncomponents: [vae_decoder]\n")
    with pytest.raises(ConfigError, match=r"b.yaml:3: not valid YAML"):
        load_spec(cfg)
