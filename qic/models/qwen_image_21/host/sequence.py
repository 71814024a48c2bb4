"""One request's joint sequence for Qwen-Image-2.1's denoiser, and the small tensors its graphs take for it.

The denoiser sees one sequence: the text encoder's rows, with each condition image's latent tokens in place of
the image slots the encoder reserved for it (one slot = 2x2 latent tokens of the 16x VAE), then the target
image's tokens. Everything before the target is the *prefix*: its keys and values do not depend on the step.

What is fixed per graph and what varies per request:
- per graph (static shapes, bucket-time constants): the padded prefix length P, the text rows T and condition
  latent rows I the graph reads, the target's token count N (its resolution), the batch, the depth;
- per request (tensor inputs, made here from Python ints): where each text run and condition image sits in the
  prefix (`index`), which image block each prefix token belongs to (`block_ids`), which prefix keys are real
  (`key_valid`: padded text and the bucket's padding dropped), and the RoPE tables (the target's frame position
  follows the prefix's length, so even the decode graph's table is per request).
So one prefill graph per (resolution, prefix bucket) serves any prompt length and any mix of condition sizes
and counts that fit its P, T and I, and one decode graph per (resolution, prefix bucket) serves the steps after.

The block-causal mask is not an input: a [P + N]^2 mask is 13 GB at 2K with ten conditions. The graph builds it
from `block_ids` and `key_valid` (O(P) numbers), by diffusers' rule ((q >= kv) or the same image block; text
strictly causal; masked keys dropped): qic.models.qwen_image_21.denoiser.prefix_attention_bias.

Prefix padding sits after the last real prefix token: its keys are masked for every query, so no real token
reads it, and it takes no RoPE position, so the target's positions are those of the unpadded sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qic.errors import ConfigError

TEXT, IMAGE = "text", "image"
SLOT_TOKENS = 4          # latent tokens per text-encoder image slot (2x2)
ROPE_THETA = 10000
# diffusers tabulates positions 0..8191 and -1024..-1 (QwenImage21Rope); beyond that its lookup fails.
ROPE_MAX_POSITION, ROPE_MIN_POSITION = 8191, -1024


def prefix_sizes(bucket: int, slots: int) -> tuple[int, int, int]:
    """(T, I, P) of a denoiser graph: the text-encoder rows it reads, the condition latent rows, the prefix length.
    Text to image: T = P = b. With condition images: T = b + slots (the encoder's rows, image slots included),
    I = 4 slots (each slot stands for 2x2 latent tokens), P = b + I (the text rows outside the slots, at most b,
    then every condition token)."""
    if not slots:
        return bucket, 0, bucket
    return bucket + slots, SLOT_TOKENS * slots, bucket + SLOT_TOKENS * slots


@dataclass(frozen=True)
class JointSequence:
    """The prefix as segments in order, ("text", n) or ("image", height, width) in latent tokens, and the
    target's (height, width). Text segments count text-encoder rows; an image consumes h*w/4 slot rows of the
    text encoder's output (never read: its latents replace them) and h*w rows of the condition latents."""

    prefix: tuple[tuple, ...]
    target: tuple[int, int]

    def __post_init__(self):
        for seg in self.prefix:
            kind = seg[0]
            if kind == TEXT and len(seg) == 2 and seg[1] >= 0:
                continue
            if kind == IMAGE and len(seg) == 3 and seg[1] > 0 and seg[2] > 0 and (seg[1] * seg[2]) % SLOT_TOKENS == 0:
                continue
            raise ConfigError(f"bad prefix segment {seg!r}: ('text', n >= 0) or ('image', h, w) with h*w a multiple "
                              f"of {SLOT_TOKENS}")
        h, w = self.target
        if h <= 0 or w <= 0:
            raise ConfigError(f"bad target grid {self.target!r}")

    @classmethod
    def from_slots(cls, slots: Sequence[bool], cond_shapes: Sequence[tuple[int, int]],
                   target: tuple[int, int]) -> JointSequence:
        """From the text encoder's image-slot mask (one bool per output row, the target's slots not included)
        and the condition grids in order. Image blocks are cut by their token counts, not by runs of slots: two
        adjacent images are one run but two blocks (as diffusers' build_token_metadata cuts them)."""
        slots = [bool(s) for s in slots]
        need = [h * w // SLOT_TOKENS for h, w in cond_shapes]
        if sum(slots) != sum(need):
            raise ConfigError(f"the text encoder reserved {sum(slots)} image slots; the condition grids "
                              f"{list(cond_shapes)} need {sum(need)}")
        segs: list[tuple] = []
        i, image = 0, 0
        while i < len(slots):
            if slots[i]:
                h, w = cond_shapes[image]
                segs.append((IMAGE, h, w))
                i += need[image]
                image += 1
            else:
                j = i
                while j < len(slots) and not slots[j]:
                    j += 1
                segs.append((TEXT, j - i))
                i = j
        return cls(tuple(segs), tuple(target))

    @property
    def prefix_len(self) -> int:
        return sum(s[1] if s[0] == TEXT else s[1] * s[2] for s in self.prefix)

    @property
    def target_len(self) -> int:
        return self.target[0] * self.target[1]

    @property
    def text_rows(self) -> int:
        """Text-encoder output rows the prefix spans (image slots included)."""
        return sum(s[1] if s[0] == TEXT else s[1] * s[2] // SLOT_TOKENS for s in self.prefix)

    @property
    def cond_rows(self) -> int:
        return sum(s[1] * s[2] for s in self.prefix if s[0] == IMAGE)


def prefix_inputs(seq: JointSequence, prefix_len: int, text_rows: int,
                  text_valid: torch.Tensor | None = None, batch: int = 1):
    """(index [P] int64, block_ids [P] int64, key_valid [B, P] bool) for a graph of prefix length P = prefix_len
    that reads `text_rows` text-encoder rows (the graph's T; condition latents follow them in index space).

    index: prefix position -> row of [txt_in(text rows) | img_in(condition latent rows)], the gather that
      assembles the prefix. Padding positions read row 0 (any row: their keys are masked).
    block_ids: -1 for text and padding, the image's number (0, 1, ...) for a condition image's tokens.
    key_valid: False at padding, and at text rows `text_valid` [B, T] marks invalid (diffusers'
      encoder_hidden_states_mask: a batch of prompts of different lengths).
    """
    if seq.prefix_len > prefix_len or seq.text_rows > text_rows:
        raise ConfigError(f"the request's prefix ({seq.prefix_len} tokens, {seq.text_rows} text rows) does not fit "
                          f"a graph of {prefix_len} tokens and {text_rows} text rows")
    index, ids, is_text = [], [], []
    row, cond_row, image = 0, 0, 0
    for seg in seq.prefix:
        if seg[0] == TEXT:
            index += range(row, row + seg[1])
            ids += [-1] * seg[1]
            is_text += [True] * seg[1]
            row += seg[1]
        else:
            n = seg[1] * seg[2]
            index += range(text_rows + cond_row, text_rows + cond_row + n)
            ids += [image] * n
            is_text += [False] * n
            row += n // SLOT_TOKENS
            cond_row += n
            image += 1
    pad = prefix_len - len(index)
    index = torch.tensor(index + [0] * pad, dtype=torch.long)
    block_ids = torch.tensor(ids + [-1] * pad, dtype=torch.long)
    real = torch.arange(prefix_len) < seq.prefix_len
    if text_valid is None:
        key_valid = real.expand(batch, prefix_len).clone()
    else:
        text_valid = text_valid.to(torch.bool)
        if text_valid.shape[1] < text_rows:
            text_valid = torch.cat([text_valid, text_valid.new_zeros(text_valid.shape[0],
                                                                     text_rows - text_valid.shape[1])], 1)
        is_text = torch.tensor(is_text + [False] * pad)
        key_valid = real & (~is_text | text_valid[:, index.clamp_max(text_rows - 1)])
    return index, block_ids, key_valid


def positions(seq: JointSequence, prefix_len: int) -> torch.Tensor:
    """[P + N, 3] int64 (frame, row, col) positions, diffusers' QwenImage21Rope rule.

    Text tokens advance one position on all three axes. An image block sits at the frame position reached so far
    with rows -(h - h//2) .. h//2 - 1 and columns likewise (centred on zero), then advances the position by
    max(h, w). The target is the last block. Prefix padding takes position 0 and advances nothing.
    """
    rows: list[torch.Tensor] = []
    p = 0

    def image(h, w):
        r = (torch.arange(h) - (h - h // 2))[:, None].expand(h, w)
        c = (torch.arange(w) - (w - w // 2))[None, :].expand(h, w)
        return torch.stack([torch.full((h, w), p), r, c], -1).reshape(-1, 3)

    for seg in seq.prefix:
        if seg[0] == TEXT:
            rows.append((p + torch.arange(seg[1]))[:, None].expand(seg[1], 3))
            p += seg[1]
        else:
            rows.append(image(seg[1], seg[2]))
            p += max(seg[1], seg[2])
    rows.append(torch.zeros(prefix_len - seq.prefix_len, 3, dtype=torch.long))
    rows.append(image(*seq.target))
    pos = torch.cat(rows, 0)
    if int(pos.max()) > ROPE_MAX_POSITION or int(pos.min()) < ROPE_MIN_POSITION:
        raise ConfigError(f"RoPE positions {int(pos.min())}..{int(pos.max())} exceed the range diffusers "
                          f"tabulates ({ROPE_MIN_POSITION}..{ROPE_MAX_POSITION})")
    return pos


def rope_tables(axes_dims: Sequence[int], seq: JointSequence, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [P + N, head_dim // 2] fp32: rows [:P] for the prefix, [P:] for the target (the decode
    graph's). Column j rotates the pair (2j, 2j+1) of each head; columns are the [frame | row | col] axes of
    axes_dims[k] // 2 each. The angles are diffusers' fp32 arithmetic (int position x fp32 inverse frequency)."""
    pos = positions(seq, prefix_len)
    angles = []
    for k, dim in enumerate(axes_dims):
        inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2).to(torch.float32).div(dim))
        angles.append(torch.outer(pos[:, k], inv_freq))
    angles = torch.cat(angles, -1)
    return torch.cos(angles), torch.sin(angles)
