"""Qwen-Image's family record (qic.family): read without importing any of the folder's torch code."""

from qic.family import Family

_PRESETS_AT_1024 = ((1024, 1024), (768, 1376), (1376, 768), (896, 1184), (1184, 896), (832, 1248), (1248, 832))

FAMILY = Family(
    name="qwen-image",
    # diffusers' text-to-image pipeline of Qwen/Qwen-Image and its fine-tunes (Qwen-Image-2512, Lightning), and the
    # Edit pipelines (built with condition sizes): Edit Plus (Qwen-Image-Edit-2509 / -2511) and Edit (-Edit)
    classes=("QwenImagePipeline", "QwenImageEditPlusPipeline", "QwenImageEditPipeline"),
    components="qic.models.qwen_image.components",
    # The runtime's text-to-image program over the graph roles text_encoder, denoiser and vae_decoder
    # (tokenize, encode, denoise with true CFG, step caching and batching, decode): docs/design.md, "Families".
    host="qic.runtime.generate",
    # Editing's program (condition images, the edit template): qic/models/qwen_image/host/
    conditions_host="qic.models.qwen_image.host",
    # An edit build without --condition-size: the seven aspect presets' shapes at the pipelines' VAE-side area,
    # 1024*1024 pixels (calculate_dimensions, as qic.models.qwen_image.host.conditions sizes an image; a test checks
    # the list against it), up to three images a request for Edit Plus (its "Picture 1..3"), one for Edit
    condition_defaults={"QwenImageEditPlusPipeline": (_PRESETS_AT_1024, 3),
                        "QwenImageEditPipeline": (_PRESETS_AT_1024, 1)},
    # Exact-length text by default (docs/benchmarks.md, "Per image": the one bucket of 128 made the step compute
    # 1.8x a short prompt's work at 128x128); its edit graphs, Ulysses and batched graphs take fixed buckets.
    exact_text=True,
    bf16_default=True,   # tests/test_bf16_fidelity.py
)
