"""Issue 10, build config: text buckets as users read them, resolution presets, scheduler overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from qic.errors import ConfigError
from qic.spec import MAX_TEXT_BUCKET, load_spec, parse_spec


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
