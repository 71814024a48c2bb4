"""The Qwen-Image prompt template and text-bucket selection.

The text encoder sees the whole templated prompt; the denoiser sees its hidden states with the
template's first DROP_TOKENS positions dropped (diffusers' prompt_template_encode_start_idx).
A text bucket is a text-encoder sequence length; its denoiser length is bucket - DROP_TOKENS.
"""

from __future__ import annotations

from collections.abc import Sequence

from qic.errors import QicError

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP_TOKENS = 34
MAX_PROMPT_TOKENS = 1024  # diffusers' tokenizer_max_length; the encoder sees at most this + DROP_TOKENS


def apply_template(prompt: str) -> str:
    return TEMPLATE.format(prompt)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `length` templated tokens; 0 (exact length, no padding) if buckets is [0]."""
    fitting = sorted(b for b in buckets if b >= length)
    if fitting:
        return fitting[0]
    if 0 in buckets:
        return 0
    raise QicError(
        f"prompt is {length} tokens with the template, longer than the largest text bucket ({max(buckets)})",
        "shorten the prompt or rebuild with a larger --text-buckets")
