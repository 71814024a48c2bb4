"""qic installed as a user installs it (`pip install .`, not editable) builds and runs the default from any
directory: nothing it needs lives outside the package (no configs/ beside it, no benchmarks in it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import MAKE_EDIT, MAKE_EDIT_BUILD, ROOT, SHAPES_RES
from training import shapes, shapes_edit

# `make run`'s prompt, read from the Makefile so the two cannot drift apart.
PROMPT = re.search(r"^PROMPT \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)[1].strip()
# `make run`'s build at the one resolution its picture is drawn at (the session's shapes_bundle: cache hits).
DEFAULT_AT_ONE_SIZE = ("--resolution", "{}x{}".format(*SHAPES_RES))


def _sources(dest: Path) -> Path:
    """The tracked files only (what a release holds), so the wheel build writes nothing into the checkout."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if f.startswith(("qic/", "pyproject.toml", "README.md")):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def _fresh_venv(path: Path) -> Path:
    """A new virtual environment whose dependencies come from this one's site-packages by a path entry (no
    download); this one's editable qic is not among them: a .pth line adds a directory to sys.path
    without running that directory's own .pth files, where the editable install's finder hooks in."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    site = Path(subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "_qic_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin"


def _qic(bin_dir: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(bin_dir / "qic"), *map(str, args)], cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_pip_installed_qic_builds_and_runs_the_default_in_an_empty_directory(tmp_path, shapes_bundle,
                                                                            shapes_edit_bundle, cache_dir):
    """`shapes_bundle` fills the session cache with the default model's graphs at the resolution `make run` draws
    at (bucket 128), and `shapes_edit_bundle` with `make edit`'s, so the builds below compile nothing; the
    installed copy computes the same spec keys, since its files are the package's (trained weights included). What
    `make run` (at that one resolution) and `make edit` do, from an empty directory: the picture shows `make run`'s
    prompt, the edit shows it edited as `make edit` says."""
    bin_dir = _fresh_venv(tmp_path / "venv")
    src = _sources(tmp_path / "src")
    # `pip install .` in its two steps: the wheel built by this environment's setuptools (no download: the
    # fresh venv's bundled setuptools is too old for pyproject builds), then installed into the fresh venv.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(src)], check=True, capture_output=True)
    (wheel,) = wheels.glob("qic-*.whl")
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True,
                   capture_output=True)
    where = subprocess.run([str(bin_dir / "python"), "-c", "import qic, importlib.util as u; print(qic.__file__); "
                            "print(u.find_spec('benchmarks')); "
                            "print(u.find_spec('training'))"], cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.split()
    assert where[0].startswith(str(tmp_path / "venv")) and "site-packages" in where[0], where  # not editable
    assert where[1] == "None", "benchmarks/ must stay out of the wheel"
    assert where[2] == "None", "training/ must stay out of the wheel (its output, the weights, is in it)"

    empty = tmp_path / "empty"
    empty.mkdir()
    _qic(bin_dir, empty, "build", *DEFAULT_AT_ONE_SIZE, "--cache-dir", cache_dir)
    _qic(bin_dir, empty, "run", "artifacts/shapes", "--prompt", PROMPT, "--output", "installed.png")
    image = np.asarray(Image.open(empty / "installed.png").convert("RGB"))
    assert shapes.means(image, PROMPT), (PROMPT, shapes.read_image(image))
    _qic(bin_dir, empty, "build", *MAKE_EDIT_BUILD, "--cache-dir", cache_dir, "--output", "artifacts/shapes-edit")
    _qic(bin_dir, empty, "run", "artifacts/shapes-edit", "--image", "installed.png", "--prompt", MAKE_EDIT, "--output",
         "edited.png")
    edited = np.asarray(Image.open(empty / "edited.png").convert("RGB"))
    assert shapes_edit.edited_as_told(edited, MAKE_EDIT, shapes.parse_prompt(PROMPT)), shapes.read_image(edited)

    # The same default through the checkout's own qic, in another empty directory: the same bytes.
    other = tmp_path / "other"
    other.mkdir()
    _qic(Path(sys.executable).parent, other, "build", *DEFAULT_AT_ONE_SIZE, "--cache-dir", cache_dir)
    _qic(Path(sys.executable).parent, other, "run", "artifacts/shapes", "--prompt", PROMPT, "--output", "checkout.png")
    assert (empty / "installed.png").read_bytes() == (other / "checkout.png").read_bytes()
