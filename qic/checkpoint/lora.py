"""LoRA files read and checked against the modules they target: the LoRAs `qic build --lora` merges into the
denoiser's checkpoint tensors (qic/builder/lora.py: W += scale * (alpha / rank) * up @ down, fp32), and the adapters a
slotted bundle takes per request (qic/runtime/lora.py).

Key formats accepted (normalised to a checkpoint module name plus a part):
- PEFT / diffusers: `[transformer.]<module>.lora_A[.default].weight`, `lora_B`, optional `<module>.alpha`;
  diffusers' `save_lora_weights` files carry alpha in the `lora_adapter_metadata` header entry instead;
- kohya: `lora_unet_<module with dots as underscores>.lora_down.weight`, `.lora_up.weight`, `.alpha`;
- ComfyUI-style trainers: a `diffusion_model.` prefix on either of the above.
Every key must name a module of the checkpoint's transformer (or of a bundle's LoRA slots) with shapes that fit;
anything else is an error naming the key: nothing is skipped silently.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from qic.checkpoint.safetensors_file import read_header
from qic.errors import ConfigError
from qic.manifest import sha256_file

_PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.")
# part name -> role; PEFT's adapter name infix (`.default.`) is dropped before matching
_PARTS = {"lora_A.weight": "down", "lora_B.weight": "up", "lora_down.weight": "down", "lora_up.weight": "up",
          "alpha": "alpha"}
_METADATA_KEY = "lora_adapter_metadata"   # diffusers' save_lora_weights: the PEFT LoraConfig as JSON


@dataclass
class _Module:
    down: str | None = None      # key in the file
    up: str | None = None
    alpha: float | None = None
    keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Lora:
    """One LoRA file checked against a checkpoint: per checkpoint tensor, the keys and factor to merge."""
    path: Path
    scale: float
    targets: Mapping[str, tuple[str, str, float]]   # "<module>.weight" -> (down key, up key, scale*alpha/rank)
    digest: str
    rank: int          # its modules' largest rank: the slot columns it takes (qic.runtime.lora)

    def delta(self, tensor_name: str) -> torch.Tensor:
        down, up, factor = self.factors([tensor_name])[tensor_name]
        return factor * (up @ down)

    def factors(self, tensor_names=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """Per module weight name (default: every one it targets): (down [r, in], up [out, r], scale * alpha / r),
        fp32, from the file's bytes read once (safetensors' safe_open kept ~64 bytes per tensor read for good, 6 KB
        per read of a small adapter, which a server reading adapters all day grew by; loading from bytes keeps
        nothing)."""
        from safetensors.torch import load
        f = load(self.path.read_bytes())
        return {name: (f[self.targets[name][0]].float(), f[self.targets[name][1]].float(), self.targets[name][2])
                for name in (self.targets if tensor_names is None else tensor_names)}


def load_lora(path: str | Path, scale: float, weights: Mapping, what: str = "the checkpoint's transformer") -> Lora:
    """Check a LoRA file against the modules it may target (`weights`: "<module>.weight" -> anything with a
    `.shape`, e.g. the denoiser's checkpoint TensorInfo; `what` names them in an error).

    Reads the header and the alpha scalars only; the matrices are read when merged."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"LoRA file {path} not found", "pass --lora FILE[:SCALE] with an existing .safetensors")
    header = read_header(path)
    flat = {name[:-len(".weight")].replace(".", "_"): name[:-len(".weight")] for name in weights
            if name.endswith(".weight")}
    modules: dict[str, _Module] = {}
    for key in sorted(header.tensors):
        module, role = _parse_key(key, flat, path)
        if f"{module}.weight" not in weights:
            raise ConfigError(f"{path}: LoRA key {key!r} names module {module!r}, which {what} does not have",
                              "use a LoRA trained for this model")
        m = modules.setdefault(module, _Module())
        m.keys.append(key)
        if role == "alpha":
            m.alpha = _scalar(path, key)
        elif getattr(m, role) is not None:
            raise ConfigError(f"{path}: LoRA keys {getattr(m, role)!r} and {key!r} both give the {role} matrix of "
                              f"{module}")
        else:
            setattr(m, role, key)
    config = _adapter_config(header.metadata, path)
    targets = {}
    for module, m in modules.items():
        if m.down is None or m.up is None:
            raise ConfigError(f"{path}: LoRA key {m.keys[0]!r} has no matching {'up' if m.up is None else 'down'} "
                              f"(lora_B/lora_up or lora_A/lora_down) matrix")
        wshape = weights[f"{module}.weight"].shape
        down, up = header.tensors[m.down].shape, header.tensors[m.up].shape
        if len(wshape) != 2 or len(down) != 2 or len(up) != 2 or down[0] != up[1] or (up[0], down[1]) != tuple(wshape):
            raise ConfigError(f"{path}: LoRA key {m.up!r} / {m.down!r}: shapes {list(up)} @ {list(down)} do not "
                              f"fit {module}.weight {list(wshape)}")
        rank = down[0]
        alpha = m.alpha if m.alpha is not None else _config_alpha(config, module, rank)
        targets[f"{module}.weight"] = (m.down, m.up, scale * alpha / rank)
    if not targets:
        raise ConfigError(f"{path}: no LoRA tensors in the file")
    rank = max(header.tensors[down].shape[0] for down, _, _ in targets.values())
    return Lora(path, scale, targets, sha256_file(path), rank)


def _parse_key(key: str, flat: Mapping[str, str], path: Path) -> tuple[str, str]:
    name = key.replace(".default.", ".")
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    if name.startswith(("lora_te", "text_encoder.")):
        raise ConfigError(f"{path}: LoRA key {key!r} targets the text encoder; qic merges denoiser LoRAs only")
    for part, role in _PARTS.items():
        if name.endswith("." + part):
            module = name[:-len(part) - 1]
            if module.startswith("lora_unet_"):  # kohya: dots flattened to underscores
                module = flat.get(module.removeprefix("lora_unet_"), module)
            return module, role
    raise ConfigError(f"{path}: LoRA key {key!r} is not a LoRA tensor qic knows (lora_A/lora_B, lora_down/lora_up, "
                      "alpha)", "convert the file to PEFT or kohya naming")


def _scalar(path: Path, key: str) -> float:
    with safe_open(str(path), "pt") as f:
        t = f.get_tensor(key)
    if t.numel() != 1:
        raise ConfigError(f"{path}: LoRA key {key!r} should be a scalar, has shape {list(t.shape)}")
    return float(t.float().item())


def _adapter_config(metadata: Mapping[str, str], path: Path) -> dict | None:
    raw = (metadata or {}).get(_METADATA_KEY)
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        raise ConfigError(f"{path}: header entry {_METADATA_KEY} is not JSON") from None
    if any(k.startswith("transformer.") for k in config):  # save_lora_weights prefixes by component
        config = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    if config.get("use_dora"):
        raise ConfigError(f"{path}: a DoRA adapter (use_dora); qic merges plain LoRAs only")
    return config


def _config_alpha(config: dict | None, module: str, rank: int) -> float:
    """No alpha tensor: the adapter config's lora_alpha (per-module alpha_pattern first, as PEFT matches it),
    else alpha = rank (a factor of 1, as diffusers loads a bare lora_A/lora_B file)."""
    if not config:
        return float(rank)
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", rank))


def lora_entry(item, key: str, source: str, entry: str) -> tuple[str, float]:
    """One LoRA entry, 'X[:SCALE]' or {key: X, "scale": SCALE} (a build config's `loras`: key "file"; a request's
    adapters: "name"), as (X, scale): X a non-empty string, the scale a finite number (1.0 when not given). `entry`:
    what the messages call it (the key it is under)."""
    if isinstance(item, Mapping):
        if key not in item or set(item) - {key, "scale"}:
            raise ConfigError(f"{source}: a {entry} must be {key.upper()}[:SCALE] or {{{key}, scale}}, got {item!r}")
        x, scale = item[key], item.get("scale", 1.0)
    elif isinstance(item, str):
        x, scale = parse_lora_arg(item)
    else:
        raise ConfigError(f"{source}: a {entry} must be {key.upper()}[:SCALE] or {{{key}, scale}}, got {item!r}")
    if not isinstance(x, str) or not x:
        raise ConfigError(f"{source}: a {entry}'s {key} must be a non-empty string, got {x!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ConfigError(f"{source}: the LoRA scale for {x} must be a finite number, got {scale!r}")
    return x, float(scale)


def parse_lora_arg(value: str) -> tuple[str, float]:
    """'FILE[:SCALE]' (or NAME[:SCALE]) -> (file, scale); a colon not followed by a number belongs to the path."""
    path, sep, tail = str(value).rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return str(value), 1.0
