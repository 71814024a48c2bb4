"""qic's one error path (qic/cli): a bad build config, a full disk, an unwritable path or an unexpected failure
is one `error:` line naming the file, with the traceback only under --debug (issue 19's finding 10)."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner

from tests.conftest import ROOT, qic
from tests.helpers import one_line_refusal as _one_line_refusal


@pytest.mark.parametrize("content,needle", [
    (b"tp: 1\n\xff\xfe: 2\n", "not UTF-8"), (b"components: 5\n", "components"), (b"resolutions: 512\n", "resolutions"),
    (b"output: null\n", "output"), (b"text_buckets: [72.5]\n", "text_buckets"), (b"xla_check: 'false'\n", "xla_check"),
    (b"- a\n- b\n", "expected a mapping")])
def test_bad_build_configs_are_one_line(tmp_path, content, needle):
    cfg = tmp_path / "b.yaml"
    cfg.write_bytes(content)
    proc = qic("build", cfg, "--cache-dir", tmp_path / "c", check=False)
    _one_line_refusal(proc, str(cfg), needle)
    assert not (ROOT / "None").exists() and not (tmp_path / "c").exists()   # nothing written


def _invoke(monkeypatch, exc, debug=False):
    """`qic build` whose work raises `exc`: what the CLI's one error path makes of it."""
    import qic.cli.build as build_verb
    from qic.cli import main

    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr(build_verb, "run_build", fail)
    monkeypatch.delenv("QIC_DEBUG", raising=False)
    return CliRunner().invoke(main, ["--debug", "build"] if debug else ["build"])


def test_disk_full_and_unwritable_paths_are_one_line_naming_the_file(monkeypatch):
    full = _invoke(monkeypatch, OSError(errno.ENOSPC, "No space left on device", "/data/bundle/weights.bin"))
    assert full.exit_code == 2, full.output
    assert "error: /data/bundle/weights.bin: No space left on device" in full.output
    assert "free some disk space" in full.output
    denied = _invoke(monkeypatch, PermissionError(errno.EACCES, "Permission denied", "/out"))
    assert denied.exit_code == 2 and "error: /out: Permission denied" in denied.output


def test_an_unexpected_failure_is_one_line_and_debug_shows_the_traceback(monkeypatch):
    quiet = _invoke(monkeypatch, RuntimeError("boom\nsecond line"))
    assert quiet.exit_code == 2 and quiet.output.splitlines()[0] == "error: internal error: RuntimeError: boom"
    assert "--debug" in quiet.output and "Traceback" not in quiet.output
    loud = _invoke(monkeypatch, RuntimeError("boom"), debug=True)
    assert isinstance(loud.exception, RuntimeError)   # raised through: click's runner holds the traceback
    os.environ.pop("QIC_DEBUG", None)


@pytest.mark.parametrize("flags,needle", [
    (["--weights", "served=elsewhere"], "'served' is the served bundle's own model name"),
    (["--weights", "alt="], "no bundle after alt="),
    (["--weights", "alt=a", "--weights", "alt=b"], "the name 'alt' is given twice"),
    (["--weights", "a", "--weights", "b"], "one bundle replaces the served weights, 2 given"),
    (["--weights-budget", "1"], "--weights-budget keeps named weight sets mapped, and none is given"),
    (["--weights", "alt=a", "--weights-budget", "0"], "--weights-budget must be a positive number of GiB"),
])
def test_serve_weight_set_flags_are_refused_in_one_line_before_anything_loads(tmp_path, flags, needle):
    """qic serve's --weights NAME=BUNDLE and --weights-budget (qic.serve.weight_sets.parse_weights): refused before
    the bundle is read (the bundle here does not exist)."""
    proc = qic("serve", tmp_path / "served", *flags, check=False)
    _one_line_refusal(proc, needle)
