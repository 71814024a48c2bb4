"""The bundle manifest as `qic run` meets it: one that is not an object, and one of a newer bundle format,
are each refused in one line before anything loads (issue 19's finding 10)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from qic.errors import BundleError
from tests.conftest import qic
from tests.helpers import one_line_refusal as _one_line_refusal


def _fake_bundle(tmp_path, manifest: str):
    b = tmp_path / "b"
    b.mkdir()
    (b / "manifest.json").write_text(manifest)
    return b


def test_a_manifest_that_is_an_array_is_one_line(tmp_path):
    _one_line_refusal(qic("run", _fake_bundle(tmp_path, "[1, 2]"), "--prompt", "x", check=False), "corrupt manifest")


def _bundle_of_format(bundle, tmp_path, fmt: int):
    """The session bundle with its manifest's format set to `fmt` (its id recomputed, its files linked)."""
    from qic.manifest import MANIFEST, bundle_id
    copy = tmp_path / f"format-{fmt}"
    shutil.copytree(bundle, copy, copy_function=os.link)
    manifest = json.loads((bundle / MANIFEST).read_text()) | {"format": fmt}
    (copy / MANIFEST).unlink()
    (copy / MANIFEST).write_text(json.dumps(manifest | {"id": bundle_id(manifest)}))
    return copy


def test_a_bundle_from_the_future_says_upgrade_before_loading_anything(bundle, tmp_path, monkeypatch):
    """A bundle made by a newer qic (format FORMAT_VERSION + 1, a valid manifest otherwise) is refused with
    "upgrade qic", not "rebuild", before any graph loads; the same bundle at this FORMAT_VERSION loads."""
    from qic.manifest import FORMAT_VERSION
    from qic.runtime import bundle as runtime_bundle
    future = _bundle_of_format(bundle, tmp_path, FORMAT_VERSION + 1)
    proc = qic("run", future, "--prompt", "x", "--output", tmp_path / "x.png", check=False)
    _one_line_refusal(proc, f"bundle format {FORMAT_VERSION + 1} is newer", "upgrade qic")
    assert "rebuild" not in proc.stderr and not (tmp_path / "x.png").exists()
    loaded = []
    monkeypatch.setattr(runtime_bundle, "verify_files", lambda *a, **k: loaded.append(a) or 0)
    with pytest.raises(BundleError, match="upgrade qic"):
        runtime_bundle.Bundle(future)
    assert not loaded   # refused at the manifest: not a file was checked, let alone a graph loaded
    assert runtime_bundle.Bundle(_bundle_of_format(bundle, tmp_path, FORMAT_VERSION)).graphs   # the control
