"""A run option is one row of qic.host.options (issue 30's seam): `qic run`'s flags, the prompts-file keys, the
serve request model, the runtime's Request and a bundle's run defaults are all made from the rows, with one check
per row (type and range) that every one of them applies. A stand-in option added as one row reaches all of them.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from qic.errors import ConfigError
from qic.host import options
from qic.host.options import FLAG, HTTP, LINE, OPTIONS, given_at
from tests.conftest import ROOT


def test_every_place_takes_exactly_the_rows_that_list_it():
    from qic.cli import main
    from qic.cli.run import _LINE_KEYS
    from qic.runtime.generate import Request
    from qic.serve.app import ImageRequest, _OpenAIFields
    from qic.spec import DEFAULT_KEYS
    flags = {p.name for p in main.commands["run"].params} - {"bundle", "prompts_file", "interactive", "tp",
                                                             "device", "weights_from", "verify_all", "verbose"}
    assert flags == {o.name for o in given_at(FLAG)}
    assert set(_LINE_KEYS) == {o.name for o in given_at(LINE)}
    assert set(ImageRequest.model_fields) - set(_OpenAIFields.model_fields) == {o.name for o in given_at(HTTP)}
    # the text-to-image program's Request: every request row but the families' own (opt_in: 2.1's kv_cache), and
    # img2img's and inpaint's image, strength and mask, and per-request LoRA
    assert [f.name for f in dataclasses.fields(Request) if f.init] == [o.name for o in OPTIONS if o.request and (
        not o.opt_in or o.name in ("image", "strength", "mask", "lora"))]
    assert set(DEFAULT_KEYS) == {o.name for o in OPTIONS if o.bundle_default}


def test_request_takes_only_the_prompt_by_position():
    """Before, serve built its Request positionally: a field added before `width` would have shifted values."""
    from qic.runtime.generate import Request
    assert Request("a cat", seed=3).seed == 3
    with pytest.raises(TypeError):
        Request("a cat", " ", 20)


@pytest.mark.parametrize("name, good, bad", [("steps", 1, 0), ("steps", 1000, 1001), ("seed", 2**63 - 1, 2**63),
                                             ("guidance", 4, float("nan")), ("cache_max_cached", -1, -2),
                                             ("prompt", "x", ""), ("negative_prompt", None, 3), ("seed", 0, True),
                                             ("cache_threshold", 0.5, "0.5")])
def test_one_check_per_row_refuses_the_same_values_everywhere(name, good, bad):
    """The row's check (qic run's flags and prompts-file lines, a bundle's defaults) and the HTTP model made
    from the same row accept and refuse the same values."""
    row = options.BY_NAME[name]
    assert row.check(good) == good
    with pytest.raises(ConfigError, match=f"^{name} must be "):
        row.check(bad)
    from pydantic import ValidationError

    from qic.serve.app import ImageRequest
    ImageRequest(**{"prompt": "x", name: good})
    with pytest.raises(ValidationError):
        ImageRequest(**{"prompt": "x", name: bad})


_STAND_IN = textwrap.dedent('''
    """A stand-in option (no model reads it), added as one row before the consumers import the table."""
    import json, sys
    from qic.host import options
    options.extend(options.RunOption("toy_strength", float, "A stand-in option.", minimum=0, bundle_default=True))
    from click.testing import CliRunner
    from qic.cli import main
    from qic.cli.run import _read_prompts
    from qic.runtime.generate import Request
    from qic.serve.app import ImageRequest
    from qic.spec import load_spec
    from qic.errors import ConfigError
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    out = {"flag": "--toy-strength" in help_text, "request": Request("x", toy_strength=0.5).toy_strength,
           "http": ImageRequest(prompt="x", toy_strength=2).toy_strength}
    path = sys.argv[1]
    open(path, "w").write('{"prompt": "x", "toy_strength": 1.5}\\n')
    out["line"] = _read_prompts(__import__("pathlib").Path(path))[0]["toy_strength"]
    open(path, "w").write('{"prompt": "x", "toy_strength": -1}\\n')
    try:
        _read_prompts(__import__("pathlib").Path(path))
    except ConfigError as e:
        out["line_refused"] = str(e)
    out["defaults"] = dict(load_spec(overrides={"defaults": {"toy_strength": 0.25}}).defaults)
    print(json.dumps(out))
''')


def test_a_new_option_is_one_row(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _STAND_IN, str(tmp_path / "p.jsonl")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["flag"] and out["request"] == 0.5 and out["http"] == 2 and out["line"] == 1.5, out
    assert "toy_strength must be a finite number >= 0, got -1" in out["line_refused"], out
    assert out["defaults"] == {"toy_strength": 0.25}, out


def test_an_option_named_twice_is_refused():
    with pytest.raises(ValueError, match="named twice: \\['seed'\\]"):
        options.extend(options.RunOption("seed", int, "again"))
    assert options.BY_NAME["seed"].default == 0 and len(options.OPTIONS) == len(set(options.BY_NAME))
