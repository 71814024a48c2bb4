"""Qwen-Image-2.1's prompt text as QwenImage21Pipeline hands it to its processor (host side): the system message
whose tokens the pipeline drops (its `_drop_idx`), the t2i / ti2i templates, the processor's <|image_pad|>
expansion (qic.host.image_tokens, with the text encoder's mRoPE positions)."""

from __future__ import annotations

from qic.host.image_tokens import IMAGE_PAD

# The pipeline's system prompt. Its `_drop_idx` is the token count of the system message as the processor's chat
# template renders it; Qwen chat templates render a system message as SYSTEM_MESSAGE (2.1's own processor files
# were not found, so that is Qwen3-VL's published template, not checked against 2.1's). It is also the prefix of
# every prompt_text, ending before a special token, so tokenizing it alone splits it as inside the prompt.
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_MESSAGE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"


def prompt_text(prompt: str, n_images: int = 0) -> str:
    """The text the pipeline hands its processor for one prompt: the t2i template, or with condition images the
    ti2i one, image i announced as "<image{i}>" and held by one <|image_pad|> (the processor expands it to the
    image's token count: expand_image_pads). An empty prompt becomes " " (Qwen has no bos token)."""
    head = f"{SYSTEM_MESSAGE}<|im_start|>user\n"
    images = " ".join(f"<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>" for i in range(1, n_images + 1))
    return f"{head}{images}{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n"
