"""LoRA slots in a build (`--lora-slots R`): the lora target's graphs get adapter inputs (qic.models.lora_slots), which
no shard holds; the manifest lists each with what the runtime needs to fill it (qic/runtime/lora.py): the
checkpoint module it belongs to, which part it is, and the dim along which this TP rank holds a chunk."""

from __future__ import annotations

import re

import torch

from qic import family
from qic.family import COLUMN, ROW
from qic.models import lora_slots
from qic.models.looped import STACKED
from qic.parallel.plans import split_dim

_NAME = re.compile(rf"(?P<module>.+)\.{lora_slots.SLOT}\.(?P<part>{'|'.join(lora_slots.PARTS)})")


def with_slots(module: torch.nn.Module, component: str, shape: dict) -> torch.nn.Module:
    """The bound module with the slots its graph's shape asks for (`lora_slots`: the rank; `batch`: images)."""
    rank = shape.get("lora_slots")
    if rank:
        comp = family.component(component)
        lora_slots.attach(module, comp.lora_modules, rank, shape.get("batch", 1), blocks=comp.blocks)
    return module


def is_slot(name: str) -> bool:
    return f".{lora_slots.SLOT}." in name


def slot_entries(component: str, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per slot tensor of a graph (its graph name: `prefix` + the module's name): its shape and dtype, the checkpoint
    module (`{i}` for a looped block's layer), its part (down, up, scale), whether it is stacked over layers, and
    `split`: the dim of the adapter's own matrix (down [r, in], up [out, r]) this rank holds a chunk of (None:
    whole), as the module's weight splits under TP."""
    out = {}
    for name, t in tensors.items():
        if not is_slot(name):
            continue
        m = _NAME.fullmatch(name[len(prefix):] if name.startswith(prefix) else name)
        module, part = m["module"], m["part"]
        stacked = f".{STACKED}." in module
        module = module.replace(f".{STACKED}.", ".{i}.")
        dim = split_dim(component, module.format(i=0) + ".weight")
        split = {("up", COLUMN): 0, ("down", ROW): 1}.get((part, dim))
        out[name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "module": module,
                     "part": part, "stacked": stacked, "split": split}
    return out
