"""The trained embedded model (`embedded:shapes`): its weights ship as package data in data/<name>/, written
by training/train_shapes.py, with trained.json holding the configs, each file's sha256, the command that
made them and the training record. Weights are stored in fp16 and widened to fp32 here (exact).

A file whose sha256 differs from trained.json's is refused naming the file: the weights are what the
meaning checks were measured on, so a damaged or edited copy must not pass for them.

`shapes-edit` (training/train_shapes_edit.py) trains only the denoiser of `shapes`: its record's `base` names that
model and the sha256 of the files it keeps (text encoder, VAE), read from the base model's folder and checked
against those digests, so a retrained base is refused rather than silently paired with this denoiser.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import torch

from qic.errors import CheckpointError

DATA = Path(__file__).resolve().parent / "data"
TRAINED = ("shapes", "shapes-edit")


def retrain(name: str) -> str:
    return f"python -m training.train_{name.replace('-', '_')}"


def folder(name: str) -> Path:
    return DATA / name


@lru_cache(maxsize=None)
def record(name: str) -> dict:
    """trained.json of a trained model (configs, files, training); CheckpointError if absent or unreadable."""
    path = folder(name) / "trained.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: the trained {name!r} model's record is missing or unreadable ({e})",
                              f"reinstall qic, or retrain: {retrain(name)}") from None
    if not isinstance(meta, dict) or not {"configs", "files"} <= set(meta):
        raise CheckpointError(f"{path}: not a trained-model record (needs configs and files)")
    return meta


def configs(name: str) -> dict:
    return json.loads(json.dumps(record(name)["configs"]))   # a deep copy callers may edit


def resolutions(name: str) -> tuple[tuple[int, int], ...]:
    """(height, width) the model was trained at, as its record says: what its default bundle holds."""
    return tuple((int(h), int(w)) for h, w in record(name)["training"]["resolutions"])


def _files(name: str) -> dict[str, tuple[str, str]]:
    """file name -> (the trained model whose folder holds it, its recorded sha256): its own, then its base's."""
    meta = record(name)
    base = meta.get("base") or {}
    return ({f: (base["model"], digest) for f, digest in base.get("files", {}).items()}
            | {f: (name, digest) for f, digest in meta["files"].items()})


def weights_digest(name: str) -> str:
    """One digest over the weight files' recorded sha256 (what an embedded checkpoint's marker keys on)."""
    files = {f: digest for f, (_, digest) in _files(name).items()}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def state_dict(name: str, component: str) -> dict[str, torch.Tensor]:
    """One component's weights as fp32, after checking the file against its recorded sha256."""
    from safetensors.torch import load

    fname = f"{component}.safetensors"
    owner, want = _files(name).get(fname, (name, None))
    path = folder(owner) / fname
    if want is None:
        raise CheckpointError(f"{folder(name) / 'trained.json'}: no {fname} listed")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the trained weights ({e.strerror or e})") from None
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise CheckpointError(f"{path}: sha256 {got[:16]}... is not the recorded {want[:16]}... (damaged or edited)",
                              f"reinstall qic, or retrain: {retrain(owner)}")
    # safetensors' load hands the tensors back in no fixed order; the checkpoint's shard split follows the
    # order, so sort it for the same files on every write.
    tensors = load(data)
    return {k: tensors[k].to(torch.float32) for k in sorted(tensors)}
