"""LoRAs merged into the denoiser's checkpoint tensors during stage 1: W += scale * (alpha / rank) * up @ down, in
fp32 (the files are read and checked by qic.checkpoint.lora). The shard key hashes this file: the merge's code."""

from __future__ import annotations

import json

import torch

from qic.checkpoint.lora import Lora


def lora_key(loras: list[Lora]) -> str:
    """What merged shards depend on: each file's content digest and scale, in merge order."""
    return json.dumps([[lo.digest, lo.scale] for lo in loras])


def merge(tensor_name: str, tensor: torch.Tensor, loras: list[Lora]) -> torch.Tensor:
    """The checkpoint tensor with every LoRA that targets it added in fp32 (unchanged if none does)."""
    hits = [lo for lo in loras if tensor_name in lo.targets]
    if not hits:
        return tensor
    out = tensor.float().clone() if tensor.dtype == torch.float32 else tensor.float()
    for lo in hits:
        out += lo.delta(tensor_name)
    return out
