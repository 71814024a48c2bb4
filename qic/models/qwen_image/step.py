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

from qic.models.qwen_image.mmdit import QwenMMDiT
from qic.models.qwen_image.ulysses import UlyssesShard


class DenoiseStep(nn.Module):
    """B images a step (B = latents' batch). cfg=True: text_embeds [2B, L, D], rows 0..B-1 the prompts and
    rows B..2B-1 their negative prompts, in the same image order, all padded to L; or, packed CFG (forward's
    negative_embeds), one image's two branches at their own lengths. cfg=False: text_embeds [B, L, D] and
    guidance is ignored (diffusers skips CFG when the scale is <= 1 or there is no negative prompt). text_mask
    [rows, L] (nonzero = valid), or None when every token is valid.
    """

    def __init__(self, mmdit: QwenMMDiT, cfg: bool = True, shard: UlyssesShard | None = None, cfg_gather=None):
        """shard: Ulysses, the denoiser run on this rank's 1/U of the tokens (qic/models/qwen_image/ulysses.py;
        None: all).
        cfg_gather: CFG-parallel, [B, S, C] -> [2B, S, C], both branches' predictions in CFG-rank order, i.e.
        [cond rows | uncond rows] (None: one device runs both). The layout's collectives, made by
        qic.models.qwen_image.ulysses.ulysses_shard and qic.parallel.sequence.cfg_gather."""
        super().__init__()
        self.mmdit = mmdit
        self.cfg = cfg
        self.shard = shard
        self.cfg_gather = cfg_gather
        self.cfg_parallel = cfg_gather is not None and cfg

    def forward(self, latents: torch.Tensor, text_embeds: torch.Tensor, text_mask: torch.Tensor | None,
                timestep: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                guidance: torch.Tensor | None, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                cfg_rank: torch.Tensor | None = None, sp_rank: torch.Tensor | None = None,
                condition: torch.Tensor | None = None, condition_mask: torch.Tensor | None = None,
                negative_embeds: torch.Tensor | None = None, neg_rope_cos: torch.Tensor | None = None,
                neg_rope_sin: torch.Tensor | None = None) -> torch.Tensor:
        """latents [B, S_img, C] packed; timestep, sigma, sigma_next: 0-dim fp32 tensors (timestep = the
        scheduler's t, i.e. sigma * 1000); guidance: 0-dim (every image) or [B] (one per image) fp32;
        rope tables from rope_tables(config, h, w, L); cfg_rank / sp_rank: this rank's CFG branch and Ulysses
        shard, [1] int64 (the parallel layouts only). Editing: condition [B, K, C], each image's condition latents
        (both CFG branches read the same), condition_mask [B, K] (nonzero = a real token, the rest spare slots),
        and rope tables over [text | image | conditions]. Packed CFG (negative_embeds given; one image, one device
        for both branches): text_embeds [1, Lc, D] the prompt's rows and negative_embeds [1, Lu, D] the negative
        prompt's, each at its own length (no mask, no padded rows), rope_cos / rope_sin over [Lc | image] and
        neg_rope_cos / neg_rope_sin over [Lu | image]. Returns the next latents [B, S_img, C] in latents' dtype."""
        if negative_embeds is not None:
            return self.packed(latents, text_embeds, negative_embeds, timestep, sigma, sigma_next, guidance,
                               (rope_cos, rope_sin), (neg_rope_cos, neg_rope_sin))
        images = latents.shape[0]
        rows = 2 * images if self.cfg else images
        if text_embeds.shape[0] != rows:
            raise ValueError(f"DenoiseStep(cfg={self.cfg}) takes text of batch {rows} for latents of batch "
                             f"{images}, got {text_embeds.shape[0]}")
        model_in, text_embeds, text_mask = branch_rows(latents, text_embeds, text_mask, self.cfg, self.cfg_parallel,
                                                       cfg_rank)
        rows = model_in.shape[0]
        t = model_timestep(timestep, latents, rows)
        if condition is not None:
            if self.shard is not None:
                raise ValueError("condition tokens under Ulysses are not implemented")
            repeat = rows // images   # both CFG branches of an image read its conditions
            condition = condition.repeat(repeat, 1, 1)
            condition_mask = None if condition_mask is None else condition_mask.repeat(repeat, 1)
        if self.shard is not None:
            pred = self.shard(self.mmdit, model_in, text_embeds, text_mask, t, rope_cos, rope_sin, sp_rank)
        else:
            pred = self.mmdit(model_in, text_embeds, text_mask, t, rope_cos, rope_sin, condition, condition_mask)
        if self.cfg_parallel:
            pred = self.cfg_gather(pred)
        return guide_and_update(latents, pred, guidance, sigma, sigma_next, self.cfg)

    def packed(self, latents, text_embeds, negative_embeds, timestep, sigma, sigma_next, guidance, rope, neg_rope):
        """forward's packed CFG: one transformer call over both branches' rows, the text of each at its length."""
        if not self.cfg or self.cfg_parallel or self.shard is not None or latents.shape[0] != 1:
            raise ValueError("packed CFG text is one image's two branches on one device (CFG on, no CFG-parallel "
                             "or Ulysses)")
        text = torch.cat([text_embeds, negative_embeds.to(text_embeds.dtype)], 1)
        pred = self.mmdit(latents.repeat(2, 1, 1), text, None, model_timestep(timestep, latents, 1), *rope,
                          negative_rope=neg_rope)
        return guide_and_update(latents, pred, guidance, sigma, sigma_next, True)


def branch_rows(latents, text_embeds, text_mask, cfg: bool, cfg_parallel: bool, cfg_rank):
    """The rows this rank's transformer runs: (latents in, text rows, their mask). With CFG each image's latents
    twice, matching the text rows' order [cond rows | uncond rows]; under CFG-parallel only this rank's branch
    (its B text rows, each image's latents once): the other CFG group computes the other branch."""
    if cfg_parallel:
        images = latents.shape[0]
        text_embeds = text_embeds.unflatten(0, (2, images)).index_select(0, cfg_rank).flatten(0, 1)
        if text_mask is not None:
            text_mask = text_mask.unflatten(0, (2, images)).index_select(0, cfg_rank).flatten(0, 1)
        return latents, text_embeds, text_mask
    return (latents.repeat(2, 1, 1) if cfg else latents), text_embeds, text_mask


def model_timestep(timestep: torch.Tensor, latents: torch.Tensor, rows: int) -> torch.Tensor:
    """The transformer's timestep input [rows]: the scheduler's t in the latents' dtype, over 1000."""
    return (timestep.to(latents.dtype) / 1000).reshape(1).expand(rows)


def guide_and_update(latents, pred, guidance, sigma, sigma_next, cfg: bool) -> torch.Tensor:
    """True CFG with norm rescale over the prediction rows [cond | uncond] (cfg), then the Euler update."""
    images = latents.shape[0]
    if cfg:
        cond, neg = pred[:images], pred[images:]
        if guidance.dim() > 0:   # one scale per image, broadcast over its tokens and channels
            guidance = guidance.reshape(images, 1, 1)
        comb = neg + guidance * (cond - neg)
        # Norms per token of each image: the rescale never mixes images.
        v = comb * (torch.linalg.vector_norm(cond, dim=-1, keepdim=True)
                    / torch.linalg.vector_norm(comb, dim=-1, keepdim=True))
    else:
        v = pred
    # 0-dim fp32 sigmas times v keep v's dtype (as in the scheduler); the sum is fp32.
    return (latents.float() + (sigma_next - sigma) * v).to(latents.dtype)
