"""Issue 30's family seam: a model family is one folder, picked by the checkpoint's model_index.json.

The stand-in family here ("stand-in family: a one-component toy", `toy_family`) is no model qic ships: it is
written by this test into tmp_path as a folder of its own (a record, one component, one eager module, a host
program) and registered the way a family outside qic is, by the `qic.families` entry point of a two-file
dist-info beside it, with tmp_path on PYTHONPATH. Nothing in qic names it. `qic build --model DIR` picks it by
its model_index.json class, builds its one graph (inductor, CPU) into a bundle whose manifest names its host
program, and `qic run` runs that program, importing neither the family's components nor its model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.conftest import ROOT, qic
from tests.helpers import one_line_refusal

CLASS = "ToyPainterPipeline"   # the stand-in's pipeline class: no diffusers class of that name exists
CHANNELS, SIZE = 4, (8, 12)    # noise channels of its one graph; the one resolution built (H, W)

_FILES = {
    "__init__.py": '"""stand-in family: a one-component toy (tests/test_family_seam.py)."""\n',
    # The record, read without importing the folder's torch code.
    "family.py": f'''
from qic.family import Family

FAMILY = Family(name="toy-painter", classes=("{CLASS}",), components="toy_family.components",
                host="toy_family.host", backends=("inductor", "export"))
''',
    # The eager module: one per-pixel linear map of noise channels to RGB, squashed to [-1, 1].
    "model.py": '''
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PainterConfig:
    channels: int

    @classmethod
    def from_dict(cls, raw):
        return cls(int(raw["channels"]))


class Painter(nn.Module):
    def __init__(self, config, tp_size=1, looped=False):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(3, config.channels))
        self.bias = nn.Parameter(torch.empty(3))

    def forward(self, noise):
        return torch.tanh(torch.einsum("oc,bchw->bohw", self.weight, noise) + self.bias[None, :, None, None])
''',
    # The component list: one component, one graph per resolution.
    "components.py": '''
import torch

from qic.builder.graphs import GraphDef
from qic.family import Component
from qic.graph_names import graph_name
from toy_family.model import Painter, PainterConfig


def _shapes(spec):
    return [{"resolution": [h, w]} for h, w in spec.resolutions]


def _graph(module, configs, shape, dtype, layout):
    h, w = shape["resolution"]
    noise = torch.zeros(1, configs["painter"].channels, h, w)
    return GraphDef(graph_name("painter", (h, w)), "painter", module, [("noise", noise)], ["image"],
                    shape={"resolution": [h, w]})


def manifest_fields(spec, ctx):
    return {"resolutions": [list(r) for r in spec.resolutions]}


COMPONENTS = {"painter": Component("painter", "painter", PainterConfig.from_dict, Painter, dict,
                                   ("toy_family.model",), _shapes, _graph, config_deps=("painter",))}
''',
    # The host program: host code only (noise from the seed, one graph call by name, pixels).
    "host.py": '''
import time
from dataclasses import dataclass, field

import torch

from qic.runtime.generate import to_pil


@dataclass
class Request:
    prompt: str
    seed: int | None = None


@dataclass
class Result:
    image: object
    request: Request
    timings: dict = field(default_factory=dict)


def noise(seed, channels, h, w):
    return torch.randn(1, channels, h, w, generator=torch.Generator().manual_seed(seed or 0))


def generate(model, req):
    t = time.perf_counter()
    h, w = model.resolutions[0]
    graph = model.graph("painter", (h, w))
    image = graph(noise(req.seed, graph.inputs[0]["shape"][1], h, w))[0]
    return Result(to_pil(image), req, {"paint": time.perf_counter() - t})
''',
}


def _stand_in_family(root: Path) -> Path:
    """The family's folder, and the dist-info that registers it, under `root` (put on PYTHONPATH)."""
    pkg = root / "toy_family"
    pkg.mkdir(parents=True)
    for name, text in _FILES.items():
        (pkg / name).write_text(text.lstrip())
    info = root / "toy_family-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[qic.families]\ntoy-painter = toy_family.family:FAMILY\n")
    return root


def _checkpoint(root: Path, class_name: str = CLASS) -> tuple[Path, dict]:
    """A diffusers-layout checkpoint of the toy: model_index.json naming its class, one component folder."""
    torch.manual_seed(0)
    weights = {"weight": torch.randn(3, CHANNELS), "bias": torch.randn(3) * 0.1}
    (root / "painter").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name,
                                                       "painter": ["toy_family", "Painter"]}))
    (root / "painter" / "config.json").write_text(json.dumps({"channels": CHANNELS}))
    save_file(weights, str(root / "painter" / "diffusion_pytorch_model.safetensors"))
    return root, weights


def _expected(weights: dict, seed: int) -> np.ndarray:
    """What the toy draws, computed here in eager fp32 from the checkpoint's tensors and the seed's noise."""
    noise = torch.randn(1, CHANNELS, *SIZE, generator=torch.Generator().manual_seed(seed))
    x = torch.tanh(torch.einsum("oc,bchw->bohw", weights["weight"], noise) + weights["bias"][None, :, None, None])
    return ((x[0] / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy() * 255).round()


@pytest.mark.slow
def test_a_stand_in_family_plugs_in_by_its_folder_alone(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(_stand_in_family(tmp_path / "site")), str(ROOT)])}
    ckpt, weights = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "bundle"
    # The export back end: the seam (a family found by its folder, its components built, its host program run)
    # is what is under test, not the compile; the toy's graph is the eager map exactly.
    qic("build", "--model", ckpt, "--resolution", "{}x{}".format(*SIZE), "--cache-dir", tmp_path / "cache",
        "--output", out, "--backend", "export", env=env)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == {"name": "toy-painter", "host": "toy_family.host"}
    assert [g["name"] for g in manifest["graphs"]] == ["painter@{}x{}".format(*SIZE)]
    assert manifest["components"] == ["painter"] and manifest["tokenizer"] is None
    assert "family toy-painter, host program toy_family.host" in qic("inspect", out, env=env).stdout

    # qic run runs the family's own host program, and imports neither its components nor its model to do so.
    probe = f"""
import sys
from qic.cli.run import run_cli
run_cli({str(out)!r}, {{"prompt": "-", "seed": 7, "output": {str(tmp_path / 'toy.png')!r}}})
print("MODULES", " ".join(sorted(m for m in sys.modules if m.startswith("toy_family"))))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("MODULES ")[1].split() == ["toy_family", "toy_family.host"], proc.stdout
    image = np.asarray(Image.open(tmp_path / "toy.png").convert("RGB"), dtype=np.float64)
    # The exported graph is the eager map in fp32 up to summation order (~1e-7 relative), so a pixel may differ
    # from the eager one by one level, only where the value sits that close to a rounding boundary.
    assert np.abs(image - _expected(weights, 7)).max() <= 1
    # ... and that bound fails for the noise of another seed, or for the checkpoint's weights negated.
    assert np.abs(image - _expected(weights, 8)).max() > 1
    assert np.abs(image - _expected({k: -v for k, v in weights.items()}, 7)).max() > 1

    # qic serve runs a bundle's host program, which must admit requests (`plan`); the toy's has none, so serve
    # refuses it in one line before loading anything.
    one_line_refusal(qic("serve", out, check=False, env=env), "host program (toy_family.host) has no `plan`",
                     "qic run")


def test_a_back_end_the_family_does_not_list_is_refused_before_any_work(tmp_path):
    """The family record's `backends` (qic.family.Family; the toy lists inductor and export): a neuron build is one line
    from the build's own check of the spec, before anything is sharded or lowered."""
    env = {"PYTHONPATH": os.pathsep.join([str(_stand_in_family(tmp_path / "site")), str(ROOT)])}
    ckpt, _ = _checkpoint(tmp_path / "ckpt")
    proc = qic("build", "--model", ckpt, "--resolution", "{}x{}".format(*SIZE), "--backend", "neuron",
               "--cache-dir", tmp_path / "cache", "--output", tmp_path / "out", check=False, env=env)
    one_line_refusal(proc, "toy-painter family", "inductor and export back ends, not neuron", "--backend inductor")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_an_unknown_pipeline_class_is_refused_in_one_line_naming_file_class_and_known(tmp_path):
    ckpt, _ = _checkpoint(tmp_path / "ckpt", class_name="NoSuchPipeline")
    proc = qic("build", "--model", ckpt, "--cache-dir", tmp_path / "cache", "--output", tmp_path / "out", check=False)
    one_line_refusal(proc, f"{ckpt / 'model_index.json'}: _class_name 'NoSuchPipeline' is no model family qic knows",
                     "(known: QwenImage21Pipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline, "
                     "QwenImagePipeline)")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr   # one line: no fix to offer
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", ["embedded", "directory"])
def test_qwen_image_checkpoints_pick_the_qwen_image_family(model, tiny_ckpt):
    """The embedded checkpoints and a diffusers-layout directory of QwenImagePipeline both pick qwen-image."""
    from qic.spec import parse_spec
    spec = parse_spec({"model": "embedded:tiny" if model == "embedded" else str(tiny_ckpt)})
    assert spec.family == "qwen-image" and spec.components == ("text_encoder", "denoiser", "vae_decoder")
