"""Low-rank adapter slots: per-request LoRA on compiled graphs (`qic build --lora-slots R`).

A slotted Linear computes y = W x + b + up (scale * (down x)) per image, where `down` [n, R, in], `up` [n, out, R]
and `scale` [n, R] are graph inputs the runtime fills per request (qic/runtime/lora.py): the request's adapters
side by side along the rank dim R (an adapter of rank r takes r of the R columns), each rank column's scale the
adapter's strength times its alpha / r. Zeros are the identity, so a request without adapters runs the base model,
and changing a strength changes only `scale`. The slot tensors are module parameters named
`<linear>.lora_slot.{down,up,scale}`: the looped form stacks them like any block tensor ([L, n, ...]) and the
graph takes them among its weight inputs, but no checkpoint or shard holds them (the builder binds zeros and the
manifest lists them: qic/builder/lora_slots.py).

Tensor parallelism: the slot is built from the Linear's own (per-rank) features, so a column-parallel Linear's
`up` holds this rank's output rows and a row-parallel one's `down` this rank's input columns; the row-parallel
sum (RowLinear) adds the slot's partial product before its all-reduce, a gathered Linear before its gather.

Rows: the slotted Linear sees the transformer's rows, n images or (CFG) 2n rows [cond rows | uncond rows] of the
same n images; a row's slot is its image's (row i and n + i read image i's).
"""

from __future__ import annotations

import re

import torch
from torch import nn

SLOT = "lora_slot"          # the child module's name: tensors `<linear>.lora_slot.<part>`
PARTS = ("down", "up", "scale")


class LoraSlot(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, images: int, dtype=torch.float32):
        super().__init__()
        self.down = nn.Parameter(torch.zeros(images, rank, in_features, dtype=dtype), requires_grad=False)
        self.up = nn.Parameter(torch.zeros(images, out_features, rank, dtype=dtype), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(images, rank, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, ..., in] -> the adapters' term [rows, ..., out]; rows a multiple of the images n."""
        n, rows = self.down.shape[0], x.shape[0]
        # [rows, T, in] -> [rows / n, n, T, in]: the leading dim repeats the images (CFG's two branches).
        xs = x.reshape(rows // n, n, -1, x.shape[-1])
        h = torch.matmul(xs, self.down.transpose(-1, -2)) * self.scale[:, None, :]
        y = torch.matmul(h, self.up.transpose(-1, -2))
        return y.reshape(*x.shape[:-1], y.shape[-1])


def slot_term(linear: nn.Module, x: torch.Tensor):
    """The Linear's slot term for input x, or None when it has no slot (every unslotted build)."""
    slot = linear._modules.get(SLOT)
    return None if slot is None else slot(x)


def attach(module: nn.Module, pattern: str, rank: int, images: int, blocks: str | None = None) -> list[str]:
    """Give every Linear of `module` whose name fully matches `pattern` a LoraSlot of `rank` for `images` images, in
    the module's dtype. Names are the checkpoint's (`transformer_blocks.3.attn.to_q`); a looped module's layer list
    (`blocks`, a qic.models.looped.StackedLayers) matches its template's Linears as layer 0's and gains stacked slot
    tensors. Returns the slotted modules' names (a looped block's as `<blocks>.{i}.<rest>`)."""
    from qic.models.looped import StackedLayers
    regex = re.compile(pattern)
    dtype = next(p.dtype for p in module.parameters())
    done = []
    stacked = module.get_submodule(blocks) if blocks else None
    looped = isinstance(stacked, StackedLayers)
    for name, m in module.named_modules():
        if looped and name.startswith(f"{blocks}."):
            continue
        if isinstance(m, nn.Linear) and regex.fullmatch(name):
            m.add_module(SLOT, LoraSlot(m.in_features, m.out_features, rank, images, dtype))
            done.append(name)
    if looped:
        for name, m in stacked.template.named_modules():
            if isinstance(m, nn.Linear) and regex.fullmatch(f"{blocks}.0.{name}"):
                m.add_module(SLOT, LoraSlot(m.in_features, m.out_features, rank, images, dtype))
                done.append(f"{blocks}.{{i}}.{name}")
        stacked.adopt_new_parameters()
    return done
