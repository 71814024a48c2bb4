"""One denoise step split in parts, so that the host can skip the middle blocks (step caching).

diffusers' FirstBlockCache and cache-dit's DBCache decide per step, from the residual of the first Fn
blocks, whether the middle blocks would change much; if not, the middle's residual stored at the last step
that computed it stands in for them. A whole-step graph cannot skip anything, so a bundle built with
`step_cache: {first: Fn, last: Bn}` also holds, per step graph:

- head:  input projections, timestep embedding, blocks 0..Fn-1 over every row (cond and uncond), and the
         decision's figure per row: the mean |r - r_prev| / mean |r_prev| of the image stream's residual
         r = (output of block Fn-1) - (input of block 0), against the r_prev the host passes (the residual
         of the row's last computed step).  -> img, txt, temb, residual, diff [rows] fp32
- mid:   blocks Fn..L-Bn-1 over one row that computes while others cache (graph "@mid@R1", built where more
         than one row may compute while others cache: batches; over all rows it runs inside `rest`).
         -> img, txt after them, and their residuals (output - input) per stream, to store
- tail:  blocks L-Bn..L-1, the output norm and projection, true CFG and the Euler update, on
         img = base + residual (and txt alike): a computed row passes (mid output, zeros), which is exact;
         a cached row (head output, its stored residual), as both references add it.
- rest:  mid and tail in one graph, for a step whose rows all compute (the tail's input is then the middle's
         output as it is), -> the next latents and the middle's residuals: a step is two graph calls whether it
         computes (head, rest) or caches (head, tail); only a step where some rows compute and others cache
         (CFG's branches deciding apart) differs:
- mixed: the middle over the one row that computes (`row`, an input) and the tail over every row, the others on
         their stored residuals, in one graph ("@mixed@R1"): head and mixed, two calls again. Only a batch's step
         where several rows compute and others cache runs the one-row middle per computing row, then the tail.

With looped layers each part is a range of the one scanned block over views of the same stacked weights, so
the split adds graphs, not weight bytes. Every row's arithmetic is independent of the other rows (the
reductions are per row), so an image's decisions do not depend on its batch. Under TP the image stream
between blocks is whole on every rank (the row-parallel outputs are all-reduced inside each block), so the
decision's means need no collective and every rank computes the same figure.

Parallel layouts (qic/parallel/mesh.py), as the whole step runs them (qic/models/qwen_image/step.py, ulysses.py):
- CFG-parallel: the head takes every text row and keeps this rank's branch (`cfg_rank`); the middle and the tail
  run that branch's rows only (the host passes their text mask rows), and the tail all-gathers the predictions
  over the CFG pair before CFG and Euler. Each branch's rows, and so its decisions, live on its own CFG group.
- Ulysses: every part runs on this rank's chunk of both streams (`sp_rank`; padded to multiples of U), with the
  interleaved key mask and RoPE chunks; the stored residuals are chunks too. The figure's two sums run over the
  real tokens of every rank (one all-reduce), so every rank of the sequence group reads the same figure, the
  one a single device computes (within fp32 rounding). The tail gathers the image tokens before the output.
"""

from __future__ import annotations

import torch
from torch import nn

from qic.models.qwen_image.mmdit import QwenMMDiT
from qic.models.qwen_image.step import branch_rows, guide_and_update, model_timestep
from qic.models.qwen_image.ulysses import UlyssesShard


def relative_l1(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Per row: mean |residual - previous| / mean |previous|, as both references compute it over one branch's
    tensor (they run each CFG branch as its own batch-1 call), in the residual's own dtype as they do (no
    upcast: a bf16 model's figure is bf16's). Returned as fp32 [rows] for the host."""
    num = (residual - previous).abs().mean(dim=(1, 2))
    return (num / previous.abs().mean(dim=(1, 2))).float()


class _Part(nn.Module):
    """What the parts share: the denoiser, and under Ulysses the token chunking of the image's `tokens`."""

    def __init__(self, mmdit: QwenMMDiT, shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__()
        self.mmdit, self.shard, self.tokens = mmdit, shard, tokens

    def mask_and_tables(self, text_mask, img, rope_cos, rope_sin, sp_rank):
        """The key mask and RoPE tables of this rank's tokens (all tokens without Ulysses)."""
        if self.shard is None:
            return self.mmdit.attention_mask(text_mask, img), rope_cos, rope_sin
        n_txt = text_mask.shape[1]
        mask = self.shard.key_mask(text_mask, img.shape[0], n_txt, self.tokens, img.device)
        return mask, self.shard.tables(rope_cos, n_txt, sp_rank), self.shard.tables(rope_sin, n_txt, sp_rank)


class StepHead(_Part):
    def __init__(self, mmdit: QwenMMDiT, first: int, cfg: bool = True, cfg_parallel: bool = False,
                 shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__(mmdit, shard, tokens)
        self.first, self.cfg, self.cfg_parallel = first, cfg, cfg_parallel and cfg

    def forward(self, latents, text_embeds, text_mask, timestep, prev_residual, rope_cos, rope_sin, cfg_rank=None,
                sp_rank=None):
        model_in, text_embeds, text_mask = branch_rows(latents, text_embeds, text_mask, self.cfg, self.cfg_parallel,
                                                       cfg_rank)
        t = model_timestep(timestep, latents, model_in.shape[0])
        if self.shard is not None:
            model_in = self.shard.split(model_in, self.tokens, sp_rank)
            text_embeds = self.shard.split(text_embeds, text_embeds.shape[1], sp_rank)
        img0, txt, temb = self.mmdit.embed(model_in, text_embeds, t)
        mask, cos, sin = self.mask_and_tables(text_mask, img0, rope_cos, rope_sin, sp_rank)
        img, txt = self.mmdit.blocks(img0, txt, temb, mask, cos, sin, 0, self.first)
        residual = img - img0
        if self.shard is None:
            diff = relative_l1(residual, prev_residual)
        else:
            diff = self.shard.relative_l1(residual, prev_residual, self.tokens, sp_rank)
        return img, txt, temb, residual, diff


class StepMiddle(_Part):
    def __init__(self, mmdit: QwenMMDiT, first: int, last: int, shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__(mmdit, shard, tokens)
        self.first, self.last = first, last

    def forward(self, img, txt, temb, text_mask, rope_cos, rope_sin, sp_rank=None):
        mask, cos, sin = self.mask_and_tables(text_mask, img, rope_cos, rope_sin, sp_rank)
        stop = self.mmdit.config.num_layers - self.last
        out_img, out_txt = self.mmdit.blocks(img, txt, temb, mask, cos, sin, self.first, stop)
        return out_img, out_txt, out_img - img, out_txt - txt


class StepTail(_Part):
    """last = 0: the tail takes no text stream (nothing after the middle reads it). cfg_gather (CFG-parallel):
    this branch's predictions -> both branches', as DenoiseStep's."""

    def __init__(self, mmdit: QwenMMDiT, last: int, cfg: bool = True, cfg_gather=None,
                 shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__(mmdit, shard, tokens)
        self.last, self.cfg, self.cfg_gather = last, cfg, cfg_gather
        self.cfg_parallel = cfg_gather is not None and cfg

    def forward(self, latents, img_base, img_residual, temb, sigma, sigma_next, guidance=None, text_mask=None,
                txt_base=None, txt_residual=None, rope_cos=None, rope_sin=None, sp_rank=None):
        img = img_base + img_residual
        tables = None
        if self.last:
            tables = self.mask_and_tables(text_mask, img, rope_cos, rope_sin, sp_rank)
        return self.finish(latents, img, txt_base + txt_residual if self.last else None, temb, sigma, sigma_next,
                           guidance, tables)

    def finish(self, latents, img, txt, temb, sigma, sigma_next, guidance, tables):
        """The last blocks (over `tables`: the key mask and RoPE tables), the output, CFG and the Euler update."""
        if self.last:
            start = self.mmdit.config.num_layers - self.last
            img, _ = self.mmdit.blocks(img, txt, temb, *tables, start, None)
        pred = self.mmdit.output(img, temb)
        if self.shard is not None:
            pred = self.shard.unsplit(pred, self.tokens)
        if self.cfg_parallel:
            pred = self.cfg_gather(pred)
        return guide_and_update(latents, pred, guidance, sigma, sigma_next, self.cfg)


class StepMixed(StepTail):
    """A step whose rows decide apart, one computing: the middle over that row (`row` [1] int64), then the tail over
    every row, the computing row on its middle's output and the others on the head's output plus their stored
    residuals (img_stored, and txt_stored when the tail runs blocks), as the tail takes them after a one-row
    middle: the same arithmetic in one graph. Returns the next latents and the computing row's residuals."""

    def __init__(self, mmdit: QwenMMDiT, first: int, last: int, cfg: bool = True, cfg_gather=None,
                 shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__(mmdit, last, cfg, cfg_gather, shard, tokens)
        self.first = first

    def forward(self, img, txt, temb, text_mask, latents, img_stored, row, sigma, sigma_next, guidance=None,
                txt_stored=None, rope_cos=None, rope_sin=None, sp_rank=None):
        def one(t):
            return t.index_select(0, row)
        tables = self.mask_and_tables(one(text_mask), one(img), rope_cos, rope_sin, sp_rank)
        stop = self.mmdit.config.num_layers - self.last
        out_img, out_txt = self.mmdit.blocks(one(img), one(txt), one(temb), *tables, self.first, stop)
        img_all = (img + img_stored).index_copy(0, row, out_img)
        txt_all, tables = None, None
        if self.last:
            txt_all = (txt + txt_stored).index_copy(0, row, out_txt)
            tables = self.mask_and_tables(text_mask, img, rope_cos, rope_sin, sp_rank)
        new_latents = self.finish(latents, img_all, txt_all, temb, sigma, sigma_next, guidance, tables)
        return new_latents, out_img - one(img), out_txt - one(txt)


class StepRest(StepTail):
    """The middle and the tail in one graph, for a step whose rows all compute: with the head, two calls a step
    whether it computes or caches (a cached step is head and tail). The middle's output goes to the last blocks as
    it is (the tail's (mid output, 0) of a computed row, without the zeros); its residuals come back to store."""

    def __init__(self, mmdit: QwenMMDiT, first: int, last: int, cfg: bool = True, cfg_gather=None,
                 shard: UlyssesShard | None = None, tokens: int = 0):
        super().__init__(mmdit, last, cfg, cfg_gather, shard, tokens)
        self.first = first

    def forward(self, img, txt, temb, text_mask, latents, sigma, sigma_next, guidance=None, rope_cos=None,
                rope_sin=None, sp_rank=None):
        tables = self.mask_and_tables(text_mask, img, rope_cos, rope_sin, sp_rank)
        stop = self.mmdit.config.num_layers - self.last
        out_img, out_txt = self.mmdit.blocks(img, txt, temb, *tables, self.first, stop)
        new_latents = self.finish(latents, out_img, out_txt, temb, sigma, sigma_next, guidance, tables)
        return new_latents, out_img - img, out_txt - txt
