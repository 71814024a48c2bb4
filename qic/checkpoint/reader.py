"""A diffusers-layout checkpoint directory: configs, index files, tensor locations and a cheap digest."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import torch

from qic import family
from qic.checkpoint.safetensors_file import Header, TensorInfo, read_header, read_tensor
from qic.errors import CheckpointError
from qic.manifest import sha256_file


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


class ComponentWeights:
    """The safetensors of one component: one file, or shards listed by an index file."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: component directory not found")

    @cached_property
    def files(self) -> list[Path]:
        indexes = sorted(self.directory.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(f"{self.directory}: more than one index file: {', '.join(p.name for p in indexes)}")
        if indexes:
            weight_map = read_json(indexes[0]).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{indexes[0]}: no weight_map")
            self._weight_map = weight_map
            names = sorted(set(weight_map.values()))
            for name in names:
                if not (self.directory / name).is_file():
                    raise CheckpointError(f"{indexes[0]}: names {name}, which does not exist in {self.directory}")
            return [self.directory / n for n in names]
        self._weight_map = None
        singles = sorted(self.directory.glob("*.safetensors"))
        if not singles:
            raise CheckpointError(f"{self.directory}: no .safetensors file and no index")
        return singles

    @cached_property
    def headers(self) -> list[Header]:
        return [read_header(p) for p in self.files]

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for h in self.headers:
            for name, info in h.tensors.items():
                if name in out:
                    raise CheckpointError(f"tensor {name} appears in both {out[name].path} and {h.path}")
                out[name] = info
        if self._weight_map is not None:
            for name, fname in self._weight_map.items():
                info = out.get(name)
                if info is None or info.path.name != fname:
                    raise CheckpointError(f"{self.directory}: index says tensor {name} is in {fname}, but it is not")
        return out

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: missing tensor {name}") from None

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        names = list(self.tensors) if names is None else list(names)
        return {n: read_tensor(self.info(n)) for n in names}


# Files of a tokenizer directory the runtime may read (either form): copied into bundles, and keyed.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json",
                   "special_tokens_map.json")


class Checkpoint:
    """A diffusers-layout checkpoint directory (model_index.json + component folders)."""

    def __init__(self, root: Path, model_id: str | None = None):
        self.root = Path(root)
        self.model_id = model_id or str(self.root)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: checkpoint directory not found",
                                  "pass --model with a local directory or a hub id")
        if not (self.root / "model_index.json").is_file():
            raise CheckpointError(f"{self.root}: no model_index.json; not a diffusers-layout checkpoint")

    def config(self, component: str) -> dict:
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        return read_json(self.root / component / name)

    def weights(self, component: str) -> ComponentWeights:
        return ComponentWeights(self.root / component)

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer's folder: the family's (qic.family.Family.tokenizer) being built or run."""
        return self.root / family.current().tokenizer

    def tokenizer_digest(self) -> str:
        """The tokenizer files' contents (small, so hashed whole): a bundle built from an edited tokenizer is
        a new bundle. Kept out of `digest`, which keys the weight shards a tokenizer does not change."""
        h = hashlib.sha256(b"qic-tokenizer-digest-v1")
        for name in TOKENIZER_FILES:
            path = self.tokenizer_dir / name
            if path.is_file():
                h.update(name.encode() + b"\0" + sha256_file(path).encode() + b"\0")
        return h.hexdigest()

    def digest(self, components: Iterable[str] | None = None, full: bool = False) -> str:
        """A cheap identity of the checkpoint: configs, headers, sizes, plus per-file content identity.

        Headers and sizes alone cannot tell Qwen-Image from Qwen-Image-2512 (same layout, same offsets),
        so each file also contributes its hub blob name (its sha256) when resolved through the hub
        cache, else size + mtime_ns + inode, or its full sha256 when `full` is asked for. `components`: checkpoint
        folders, by default those the family's components are compiled from (qic.family.folders).
        """
        components = family.folders() if components is None else tuple(components)
        h = hashlib.sha256(b"qic-checkpoint-digest-v1")
        # A family without a scheduler has no scheduler folder (Qwen-Image's always has one).
        scheduler = self.root / "scheduler" / "scheduler_config.json"
        files = [self.root / "model_index.json"] + ([scheduler] if scheduler.exists() else [])
        for comp in components:
            files.append(self.root / comp / "config.json")
        for comp in components:
            for header in self.weights(comp).headers:
                files.append(header.path)
                h.update(header.raw)
        for path in files:
            h.update(str(path.relative_to(self.root)).encode() + b"\0")
            h.update(file_identity(path, full).encode() + b"\0")
        return h.hexdigest()


def file_identity(path: Path, full: bool = False) -> str:
    st = os.stat(path)
    if full:
        return f"sha256:{sha256_file(path)}"
    if path.is_symlink():
        target = Path(os.readlink(path))
        # huggingface-hub caches store blobs named by their sha256 (LFS) or git sha1.
        if target.parent.name == "blobs" and len(target.name) in (40, 64):
            return f"blob:{target.name}"
    if path.suffix == ".json":  # small: hash content so an edited config is always seen
        return f"sha256:{sha256_file(path)}"
    return f"stat:{st.st_size}:{st.st_mtime_ns}:{st.st_dev}:{st.st_ino}"
