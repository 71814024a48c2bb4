"""Issue 10, build config: text buckets as users read them, resolution presets, scheduler overrides."""

from __future__ import annotations

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
    assert _spec(tmp_path, "text_buckets: [72]\n", text_bucket_step="512").text_buckets == (512, 1024, 1536)
    assert _spec(tmp_path, "text_bucket_step: 64\n", text_buckets="128").text_buckets == (128,)
    with pytest.raises(ConfigError, match="not both"):
        parse_spec({"text_buckets": [128], "text_bucket_step": 64})
    for bad in (0, -64, "x"):
        with pytest.raises(ConfigError, match="text_bucket_step"):
            parse_spec({"text_bucket_step": bad})
    with pytest.raises(ConfigError, match="0 alone"):
        parse_spec({"text_buckets": "0,128"})
