"""Qwen-Image-2.1's family record (qic.family): read without importing any of the folder's torch code."""

from qic.family import Family

FAMILY = Family(
    name="qwen-image-2.1",
    classes=("QwenImage21Pipeline",),        # diffusers' pipeline of Qwen/Qwen-Image-2.1
    components="qic.models.qwen_image_21.components",
    # Its own program: a prefill of [text | target] on the first step, decodes against the resident prefix K/V
    # after it (the runtime's text-to-image program calls one whole-step graph a step, which 2.1 has not).
    host="qic.models.qwen_image_21.host",
    tokenizer="processor",                    # the pipeline's Qwen3VLProcessor folder holds the tokenizer files
    backends=("inductor", "neuron", "export"),   # neuron: every graph lowered to HLO and checked on XLA:CPU at build
)
