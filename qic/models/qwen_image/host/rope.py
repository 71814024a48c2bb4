"""Qwen-Image's denoiser RoPE on the host: positions and cos/sin tables, pure functions of Python ints.

The MMDiT takes its tables as inputs (qic.models.qwen_image.mmdit), so one definition serves the build (the
text-to-image step graphs hold them as buffers per resolution and bucket) and the editing host program (whose
condition images' grids change per request, so it computes them per request and passes them in). Same fp32
arithmetic as diffusers' QwenEmbedRope; host code only, no nn.Module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qic.errors import ConfigError

# diffusers' class constants (not in config.json): RoPE theta and the positions it tabulates per sign.
ROPE_THETA = 10000
ROPE_POSITIONS = 4096


def _axis_angles(pos: torch.Tensor, dim: int) -> torch.Tensor:
    # Same fp32 arithmetic as diffusers' rope_params (int positions x fp32 inverse frequencies).
    inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    return torch.outer(pos, inv_freq)


def _grid_positions(height: int, width: int, frame: int) -> torch.Tensor:
    # scale_rope=True: rows run -(h - h//2) .. h//2 - 1 (centred, negatives for the upper half), columns likewise
    rows = torch.arange(height) - (height - height // 2)
    cols = torch.arange(width) - (width - width // 2)
    return torch.stack([torch.full((height, width), frame, dtype=torch.long),
                        rows[:, None].expand(height, width), cols[None, :].expand(height, width)], -1).reshape(-1, 3)


def rope_positions(height: int, width: int, txt_len: int, conditions: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """[txt_len + height*width + sum(rows*cols of conditions), 3] int64 (frame, row, col) positions, joint order
    [text | image | condition 1 | ...].

    Image k (0 the output, then the condition grids in order) sits at frame k, its rows and columns centred.
    Text token i sits at max over every grid of max(h//2, w//2), plus i, on all three axes; diffusers takes i
    over the padded text length, so padding never moves the valid tokens' positions.
    """
    grids = [(height, width), *conditions]
    images = [_grid_positions(h, w, frame) for frame, (h, w) in enumerate(grids)]
    txt = (max(max(h // 2, w // 2) for h, w in grids) + torch.arange(txt_len))[:, None].expand(txt_len, 3)
    return torch.cat([txt, *images], 0)


def check_positions(height: int, width: int, txt_len: int, conditions: Sequence[tuple[int, int]] = ()) -> None:
    """The positions must lie in diffusers' table: else one line naming the grids."""
    grids = [(height, width), *conditions]
    if (max(max(h // 2, w // 2) for h, w in grids) + txt_len > ROPE_POSITIONS
            or max(max(h, w) for h, w in grids) > ROPE_POSITIONS or len(grids) > ROPE_POSITIONS):
        conds = "".join(f", condition {h}x{w}" for h, w in conditions)
        raise ConfigError(f"grid {height}x{width}{conds} with {txt_len} text tokens exceeds the {ROPE_POSITIONS} "
                          "RoPE positions diffusers tabulates")


def position_tables(axes_dims: Sequence[int], pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of int64 (frame, row, col) positions [N, 3]: [N, head_dim // 2] each, fp32 (axes_dims: the
    transformer config's axes_dims_rope)."""
    angles = torch.cat([_axis_angles(pos[:, k], dim) for k, dim in enumerate(axes_dims)], -1)
    return torch.cos(angles), torch.sin(angles)


def grid_tables(axes_dims: Sequence[int], height: int, width: int, txt_len: int,
                conditions: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [rope_positions' rows, head_dim // 2] fp32, for a packed grid height x width (and the
    packed grids of condition images, editing's). Columns are [frame | row | col] axes of axes_dims[k] // 2 each,
    as in diffusers."""
    check_positions(height, width, txt_len, conditions)
    return position_tables(axes_dims, rope_positions(height, width, txt_len, conditions))
