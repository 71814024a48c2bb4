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


# The Edit pipelines' template (QwenImageEditPipeline, QwenImageEditPlusPipeline): another system message, whose
# first EDIT_DROP_TOKENS tokens the denoiser never sees (their prompt_template_encode_start_idx). Edit (v1) holds its
# one image inline before the prompt; Edit Plus announces each as "Picture i: " before the prompt.
EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_DROP_TOKENS = 64
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"   # one image, before the processor expands the pad


def edit_prompt_text(prompt: str, images: int, plus: bool = True) -> str:
    """The text an Edit pipeline hands its processor for one prompt and `images` condition images (Edit: one)."""
    if plus:
        head = "".join(f"Picture {i}: {VISION_TOKENS}" for i in range(1, images + 1))
    elif images == 1:
        head = VISION_TOKENS
    else:
        raise QicError(f"Qwen-Image-Edit takes one condition image, got {images}",
                       "use an Edit Plus checkpoint (2509, 2511) for several")
    return f"{EDIT_SYSTEM}{head}{prompt}<|im_end|>\n<|im_start|>assistant\n"


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
