"""One whole denoise step as one graph: denoiser (cond + uncond as one batch), true CFG with norm rescale,
and the flow-matching Euler update.

Arithmetic and dtypes follow diffusers' QwenImagePipeline.__call__ and FlowMatchEulerDiscreteScheduler.step:
- the transformer gets `t.to(latents.dtype) / 1000`, t being the scheduler's timestep (sigma * 1000, fp32);
- CFG runs in the model's output dtype: comb = neg + g * (cond - neg); v = comb * (||cond|| / ||comb||),
  norms over the last (channel) dim, per token;
- Euler: latents upcast to fp32, x + (sigma_next - sigma) * v, cast back. diffusers casts back to the model
  output's dtype; we cast to the latents' dtype so the step is a fixed point of its own signature (identical
  whenever latents and model share a dtype, as they do in the pipeline).
"""

from __future__ import annotations

import torch
from torch import nn

from qic.models.mmdit import QwenMMDiT


class DenoiseStep(nn.Module):
    """cfg=True: text_embeds [2, L, D], row 0 the prompt, row 1 the negative prompt, both padded to L.
    cfg=False: text_embeds [1, L, D] and guidance is ignored (diffusers skips CFG when the scale is <= 1 or
    there is no negative prompt). text_mask [B, L] (nonzero = valid), or None when every token is valid.
    """

    def __init__(self, mmdit: QwenMMDiT, cfg: bool = True):
        super().__init__()
        self.mmdit = mmdit
        self.cfg = cfg

    def forward(self, latents: torch.Tensor, text_embeds: torch.Tensor, text_mask: torch.Tensor | None,
                timestep: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                guidance: torch.Tensor | None, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        """latents [1, S_img, C] packed; timestep, sigma, sigma_next, guidance: 0-dim fp32 tensors
        (timestep = the scheduler's t, i.e. sigma * 1000); rope tables from rope_tables(config, h, w, L).
        Returns the next latents [1, S_img, C] in latents' dtype."""
        batch = 2 if self.cfg else 1
        if latents.shape[0] != 1 or text_embeds.shape[0] != batch:
            raise ValueError(f"DenoiseStep(cfg={self.cfg}) takes latents of batch 1 and text of batch {batch}, "
                             f"got {latents.shape[0]} and {text_embeds.shape[0]}")
        t = (timestep.to(latents.dtype) / 1000).reshape(1).expand(batch)
        pred = self.mmdit(latents.expand(batch, -1, -1), text_embeds, text_mask, t, rope_cos, rope_sin)
        if self.cfg:
            cond, neg = pred[0:1], pred[1:2]
            comb = neg + guidance * (cond - neg)
            v = comb * (torch.linalg.vector_norm(cond, dim=-1, keepdim=True)
                        / torch.linalg.vector_norm(comb, dim=-1, keepdim=True))
        else:
            v = pred
        # 0-dim fp32 sigmas times v keep v's dtype (as in the scheduler); the sum is fp32.
        return (latents.float() + (sigma_next - sigma) * v).to(latents.dtype)
