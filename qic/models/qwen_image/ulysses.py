"""Ulysses sequence parallelism for the denoiser: each of U ranks runs the blocks on 1/U of the tokens.

What one rank of a Ulysses group does with the whole step's inputs (every rank gets the same latents and
text, so latents stay identical everywhere):
- pad the image tokens N and the text tokens T to multiples of U (zeros; padding keys are masked out, padding
  queries are dropped at the end), and take this rank's contiguous chunk of each, chosen by `sp_rank` (a
  graph input: one graph serves every rank) - and the matching chunks of the RoPE tables;
- run the input projections, blocks and output projection on its chunk; inside each attention
  (JointAttention.exchange) one all-to-all gives every rank all tokens of 1/U of the heads, and one back;
- gather the output projection's image tokens from every rank (`gather`, a collective the step graph's maker
  passes in: ulysses_shard below) and drop the padding.

Key order. A rank's chunk is [its text tokens | its image tokens], so after the all-to-all the keys are in
rank-interleaved order [txt_0 | img_0 | txt_1 | img_1 | ...], not [text | image]: the key-padding mask is
built in that order (`interleaved_key_mask`). Attention is invariant to the order of its keys, so with the
matching mask the result is exact: xDiT passes no mask under sequence parallelism and attends to padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qic.parallel.sequence import ulysses_collectives


def padded(n: int, size: int) -> int:
    return -(-n // size) * size


def interleaved_key_mask(txt_valid: torch.Tensor, img_valid: torch.Tensor, size: int) -> torch.Tensor:
    """[B, T_pad] and [B, N_pad] bool -> [B, T_pad + N_pad] in the all-to-all's key order: rank by rank, that
    rank's text chunk then its image chunk."""
    b = txt_valid.shape[0]
    return torch.cat([txt_valid.unflatten(1, (size, -1)), img_valid.unflatten(1, (size, -1))], 2).reshape(b, -1)


def _chunk(x: torch.Tensor, dim: int, size: int, rank: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous 1/size of dim (which divides), selected by a [1] int64 tensor."""
    return x.unflatten(dim, (size, -1)).index_select(dim, rank).squeeze(dim)


def _pad_tokens(x: torch.Tensor, to: int) -> torch.Tensor:
    """Pad dim 1 of [B, S, ...] (or dim 0 of a [S, ...] table) with zeros to `to` rows."""
    return x if x.shape[-2] == to else F.pad(x, (0, 0, 0, to - x.shape[-2]))


class UlyssesShard(nn.Module):
    """Runs a QwenMMDiT's forward on this rank's tokens; same signature plus `sp_rank`, same output. Its
    pieces (split, key_mask, tables, unsplit, relative_l1) are also what the step-caching parts
    (qic/models/qwen_image/step_cache.py) use to run a range of the blocks on the same chunks."""

    def __init__(self, size: int, gather=None, reduce=None):
        """gather: [B, n, C] -> [size, B, n, C], every rank's chunk; reduce: a sum over the group (the step-cache
        figure's two sums). Both the sequence group's collectives (qic.parallel.sequence.ulysses_collectives)."""
        super().__init__()
        self.size, self.gather, self.reduce = size, gather, reduce

    def split(self, x: torch.Tensor, n: int, sp_rank: torch.Tensor) -> torch.Tensor:
        """[B, n, ...] -> this rank's chunk [B, padded(n) / U, ...] of the zero-padded tokens."""
        return _chunk(_pad_tokens(x, padded(n, self.size)), 1, self.size, sp_rank)

    def key_mask(self, text_mask: torch.Tensor | None, b: int, n_txt: int, n_img: int,
                 device: torch.device) -> torch.Tensor:
        """[B, 1, 1, K]: prompt padding and both streams' Ulysses padding masked, in the all-to-all's key order."""
        u = self.size
        if text_mask is None:
            txt_valid = torch.ones(b, n_txt, dtype=torch.bool, device=device)
        else:
            txt_valid = text_mask.to(torch.bool)
        txt_valid = F.pad(txt_valid, (0, padded(n_txt, u) - n_txt), value=False)
        img_valid = (torch.arange(padded(n_img, u), device=device) < n_img).expand(b, padded(n_img, u))
        return interleaved_key_mask(txt_valid, img_valid, u)[:, None, None, :]

    def tables(self, t: torch.Tensor, n_txt: int, sp_rank: torch.Tensor) -> torch.Tensor:
        """A RoPE table [T + N, D/2] in [text | image] order -> this rank's [text chunk | image chunk]."""
        u = self.size
        n_img = t.shape[0] - n_txt
        return torch.cat([_chunk(_pad_tokens(t[:n_txt], padded(n_txt, u)), 0, u, sp_rank),
                          _chunk(_pad_tokens(t[n_txt:], padded(n_img, u)), 0, u, sp_rank)], 0)

    def unsplit(self, out: torch.Tensor, n_img: int) -> torch.Tensor:
        """This rank's image tokens [B, N_pad / U, C] -> every rank's, unpadded: [B, N, C]."""
        b = out.shape[0]
        out = self.gather(out)                                     # [U, B, N_pad / U, C]
        return out.movedim(0, 1).reshape(b, -1, out.shape[-1])[:, :n_img]

    def relative_l1(self, residual: torch.Tensor, previous: torch.Tensor, n_img: int,
                    sp_rank: torch.Tensor) -> torch.Tensor:
        """Step caching's figure over the whole image stream from this rank's chunk: per row, sum |r - r_prev| /
        sum |r_prev| over the real (unpadded) tokens of every rank (one all-reduce of the two sums). The same ratio
        as one device's mean / mean (equal counts cancel), summed in fp32: equal to it within fp32 rounding."""
        local = residual.shape[1]
        real = (torch.arange(local, device=residual.device) + sp_rank * local < n_img).to(residual.dtype)
        real = real[None, :, None]
        sums = torch.stack([((residual - previous).abs() * real).float().sum(dim=(1, 2)),
                            (previous.abs() * real).float().sum(dim=(1, 2))])
        sums = self.reduce(sums)
        return sums[0] / sums[1]

    def forward(self, mmdit, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                rope_cos, rope_sin, sp_rank):
        b, n_img = hidden_states.shape[:2]
        n_txt = encoder_hidden_states.shape[1]
        mask = self.key_mask(encoder_hidden_states_mask, b, n_txt, n_img, hidden_states.device)
        img = self.split(hidden_states, n_img, sp_rank)
        txt = self.split(encoder_hidden_states, n_txt, sp_rank)
        img, txt, temb = mmdit.embed(img, txt, timestep)
        img, _ = mmdit.blocks(img, txt, temb, mask, self.tables(rope_cos, n_txt, sp_rank),
                              self.tables(rope_sin, n_txt, sp_rank))
        return self.unsplit(mmdit.output(img, temb), n_img)     # this rank's tokens, gathered and unpadded


def ulysses_shard(layout) -> UlyssesShard | None:
    """A step graph's Ulysses token sharding with the sequence group's token gather and figure sum
    (qic.parallel.sequence.ulysses_collectives; None: no Ulysses)."""
    collectives = ulysses_collectives(layout)
    return None if collectives is None else UlyssesShard(layout.ulysses, *collectives)
