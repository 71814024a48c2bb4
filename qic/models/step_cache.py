"""One denoise step split in three graphs, so that the host can skip the middle blocks (step caching).

diffusers' FirstBlockCache and cache-dit's DBCache decide per step, from the residual of the first Fn
blocks, whether the middle blocks would change much; if not, the middle's residual stored at the last step
that computed it stands in for them. A whole-step graph cannot skip anything, so a bundle built with
`step_cache: {first: Fn, last: Bn}` also holds, per step graph:

- head:  input projections, timestep embedding, blocks 0..Fn-1 over every row (cond and uncond), and the
         decision's figure per row: the mean |r - r_prev| / mean |r_prev| of the image stream's residual
         r = (output of block Fn-1) - (input of block 0), against the r_prev the host passes (the residual
         of the row's last computed step).  -> img, txt, temb, residual, diff [rows] fp32
- mid:   blocks Fn..L-Bn-1 over the rows that compute (all of them, or one row: graph "@mid@R1").
         -> img, txt after them, and their residuals (output - input) per stream, to store
- tail:  blocks L-Bn..L-1, the output norm and projection, true CFG and the Euler update, on
         img = base + residual (and txt alike): a computed row passes (mid output, zeros), which is exact;
         a cached row (head output, its stored residual), as both references add it.

With looped layers each part is a range of the one scanned block over views of the same stacked weights, so
the split adds graphs, not weight bytes. Every row's arithmetic is independent of the other rows (the
reductions are per row), so an image's decisions do not depend on its batch. Under TP the image stream
between blocks is whole on every rank (the row-parallel outputs are all-reduced inside each block), so the
decision's means need no collective and every rank computes the same figure.
"""

from __future__ import annotations

import torch
from torch import nn

from qic.models.mmdit import QwenMMDiT
from qic.models.step import guide_and_update, model_timestep


def relative_l1(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Per row: mean |residual - previous| / mean |previous|, as both references compute it over one branch's
    tensor (they run each CFG branch as its own batch-1 call), in the residual's own dtype as they do (no
    upcast: a bf16 model's figure is bf16's). Returned as fp32 [rows] for the host."""
    num = (residual - previous).abs().mean(dim=(1, 2))
    return (num / previous.abs().mean(dim=(1, 2))).float()


class StepHead(nn.Module):
    def __init__(self, mmdit: QwenMMDiT, first: int, cfg: bool = True):
        super().__init__()
        self.mmdit, self.first, self.cfg = mmdit, first, cfg

    def forward(self, latents, text_embeds, text_mask, timestep, prev_residual, rope_cos, rope_sin):
        rows = text_embeds.shape[0]
        model_in = latents.repeat(2, 1, 1) if self.cfg else latents
        img0, txt, temb = self.mmdit.embed(model_in, text_embeds, model_timestep(timestep, latents, rows))
        mask = self.mmdit.attention_mask(text_mask, img0)
        img, txt = self.mmdit.blocks(img0, txt, temb, mask, rope_cos, rope_sin, 0, self.first)
        residual = img - img0
        return img, txt, temb, residual, relative_l1(residual, prev_residual)


class StepMiddle(nn.Module):
    def __init__(self, mmdit: QwenMMDiT, first: int, last: int):
        super().__init__()
        self.mmdit, self.first, self.last = mmdit, first, last

    def forward(self, img, txt, temb, text_mask, rope_cos, rope_sin):
        mask = self.mmdit.attention_mask(text_mask, img)
        stop = self.mmdit.config.num_layers - self.last
        out_img, out_txt = self.mmdit.blocks(img, txt, temb, mask, rope_cos, rope_sin, self.first, stop)
        return out_img, out_txt, out_img - img, out_txt - txt


class StepTail(nn.Module):
    """last = 0: the tail takes no text stream (nothing after the middle reads it)."""

    def __init__(self, mmdit: QwenMMDiT, last: int, cfg: bool = True):
        super().__init__()
        self.mmdit, self.last, self.cfg = mmdit, last, cfg

    def forward(self, latents, img_base, img_residual, temb, sigma, sigma_next, guidance=None, text_mask=None,
                txt_base=None, txt_residual=None, rope_cos=None, rope_sin=None):
        img = img_base + img_residual
        if self.last:
            txt = txt_base + txt_residual
            mask = self.mmdit.attention_mask(text_mask, img)
            start = self.mmdit.config.num_layers - self.last
            img, _ = self.mmdit.blocks(img, txt, temb, mask, rope_cos, rope_sin, start, None)
        pred = self.mmdit.output(img, temb)
        return guide_and_update(latents, pred, guidance, sigma, sigma_next, self.cfg)
