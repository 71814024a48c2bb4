"""Qwen-Image's family record (qic.family): read without importing any of the folder's torch code."""

from qic.family import Family

FAMILY = Family(
    name="qwen-image",
    # diffusers' text-to-image pipeline of Qwen/Qwen-Image and its fine-tunes (Qwen-Image-2512, Lightning), and the
    # Edit Plus pipeline of Qwen-Image-Edit-2509 / -2511 (built with condition sizes)
    classes=("QwenImagePipeline", "QwenImageEditPlusPipeline"),
    components="qic.models.qwen_image.components",
    # The runtime's text-to-image program over the graph roles text_encoder, denoiser and vae_decoder
    # (tokenize, encode, denoise with true CFG, step caching and batching, decode): docs/design.md, "Families".
    host="qic.runtime.generate",
    # Editing's program (condition images, the edit template): qic/models/qwen_image/host/
    conditions_host="qic.models.qwen_image.host",
)
