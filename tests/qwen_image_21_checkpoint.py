"""A tiny random Qwen-Image-2.1 checkpoint in the real diffusers layout, made with diffusers' and transformers'
own classes (test-only: qic's code never imports them), and the processor stand-in its pipeline runs with.

Layout as the hub's Qwen/Qwen-Image-2.1 (tests/fixtures/qwen-image-2.1-configs): model_index.json
(QwenImage21Pipeline), scheduler/ (the published scheduler config), text_encoder/ (Qwen3VLForConditionalGeneration,
a vision tower of depth 1), transformer/ (QwenImage21Transformer2DModel), vae/ (AutoencoderKLQwenImage21) and
processor/ (the tokenizer files, its chat template and the image processor's config). The tokenizer is qic's
embedded byte-level BPE (qic.checkpoint.embedded.tokenizer_files): Qwen2's special tokens, so <|image_pad|> and the
chat markers are single tokens as in the real vocabulary.

Why a processor stand-in: transformers' Qwen3VLProcessor needs a video processor, which needs torchvision, which
this environment lacks, so QwenImage21Pipeline.from_pretrained is given `processor=TextProcessor(...)`. For
text-to-image the pipeline asks two things of its processor, and the stand-in does exactly what Qwen3VLProcessor
does for them: the chat template of the system message (the tokenizer's own apply_chat_template, batched as the
processor returns it) and the tokenization of the prompt texts (the tokenizer call; with no image there is no
<|image_pad|> to expand). It refuses images.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qic.checkpoint.embedded import tokenizer_files
from qic.checkpoint.presets import TOKENIZER_VOCAB, special_id
from tests.helpers import images_only_processor, sensitize_

FIXTURES = Path(__file__).parent / "fixtures" / "qwen-image-2.1-configs"
Z = 16   # latent channels: the VAE's z_dim and the transformer's in/out channels (the pipeline requires them equal)
TEXT_HIDDEN = 48

# Qwen3-VL's chat template for what the pipeline renders (a system message of text parts): each message as
# <|im_start|>role\n{text}<|im_end|>\n, content a string or a list of {"type": "text"} parts. Written here.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Odd head counts at TP 2 (6 heads: 3 a rank; GQA 3:1 in the text model, 6 query / 2 key-value heads), so one
# checkpoint serves the TP 1 and TP 2 tests; two layers each, widths a few tens (the SwiGLU's 80 and 288 divide by 2).
TEXT_CONFIG = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                    "mrope_interleaved": True})
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                     deepstack_visual_indexes=[0])
TRANSFORMER_CONFIG = dict(num_layers=2, attention_head_dim=16, num_attention_heads=6, in_channels=Z,
                          out_channels=Z, context_in_dim=TEXT_HIDDEN, mlp_ratio=3, axes_dims_rope=[4, 6, 6])
# Five stages (16x), the published temporal flags, small widths (tests/test_qwen_image_21_vae.py's model).
VAE_CONFIG = dict(base_dim=4, decoder_base_dim=6, z_dim=Z, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=1,
                  temperal_downsample=[False, True, True, True],
                  latents_mean=[0.3 * ((i % 5) - 2) for i in range(Z)],
                  latents_std=[0.5 + 0.25 * (i % 4) for i in range(Z)])
# Qwen3-VL's published image processor settings at this vision tower's patch size.
PREPROCESSOR_CONFIG = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
# sensitize_ leaves the VAE's pre-clamp output wide (most pixels on the +-1 clamp); a smaller last conv keeps
# pixels inside, where a difference shows.
VAE_CONV_OUT_SCALE = 0.3


def write_checkpoint(root: Path, seed: int = 0, sample_sigmas: list[float] | None = None) -> Path:
    """Write the checkpoint into `root` (created); weights re-drawn by tests.helpers.sensitize_ so that every
    weight shows in the image. Returns root."""
    import diffusers
    import transformers

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    te_config = transformers.Qwen3VLConfig(
        text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, image_token_id=special_id("<|image_pad|>"),
        vision_start_token_id=special_id("<|vision_start|>"), vision_end_token_id=special_id("<|vision_end|>"),
        video_token_id=special_id("<|video_pad|>"))
    text_encoder = sensitize_(transformers.Qwen3VLForConditionalGeneration(te_config), seed=seed)
    text_encoder.save_pretrained(root / "text_encoder")
    transformer = sensitize_(diffusers.QwenImage21Transformer2DModel(**TRANSFORMER_CONFIG), seed=seed + 1)
    transformer.save_pretrained(root / "transformer")
    vae = sensitize_(diffusers.AutoencoderKLQwenImage21(**VAE_CONFIG), seed=seed + 2)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(VAE_CONV_OUT_SCALE)
    vae.save_pretrained(root / "vae")
    scheduler = json.loads((FIXTURES / "scheduler" / "scheduler_config.json").read_text())
    diffusers.FlowMatchEulerDiscreteScheduler.from_config(scheduler).save_pretrained(root / "scheduler")
    proc = root / "processor"
    proc.mkdir(exist_ok=True)
    for name, data in tokenizer_files().items():
        (proc / name).write_bytes(data)
    (proc / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (proc / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    index = json.loads((FIXTURES / "model_index.json").read_text())
    if sample_sigmas is not None:
        index["sample_sigmas"] = list(sample_sigmas)
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


class TextProcessor:
    """Qwen3VLProcessor's text-only behaviour over the checkpoint's tokenizer (module docstring: why)."""

    def __init__(self, root: Path):
        import transformers
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(Path(root) / "processor")
        self.tokenizer.chat_template = (Path(root) / "processor" / "chat_template.jinja").read_text()

    def apply_chat_template(self, conversation, tokenize=False, return_dict=False, **kwargs):
        out = self.tokenizer.apply_chat_template(conversation, tokenize=tokenize, return_dict=False, **kwargs)
        return [out] if tokenize else out   # the processor batches: one conversation -> [[ids]]

    def __call__(self, text=None, images=None, **kwargs):
        if images is not None:
            raise NotImplementedError("the text-only processor stand-in takes no images")
        return self.tokenizer(text, **kwargs)


def load_pipeline(root: Path):
    """diffusers' QwenImage21Pipeline on the checkpoint, fp32 on CPU: each component by its class's own
    from_pretrained of its folder, the pipeline's sample_sigmas from model_index.json, and the processor stand-in.
    (QwenImage21Pipeline.from_pretrained refuses a processor that is not a ProcessorMixin.)"""
    import diffusers
    import transformers

    root = Path(root)
    index = json.loads((root / "model_index.json").read_text())
    return diffusers.QwenImage21Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=diffusers.AutoencoderKLQwenImage21.from_pretrained(root / "vae", torch_dtype=torch.float32),
        text_encoder=transformers.Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder",
                                                                                  dtype=torch.float32),
        processor=TextProcessor(root),
        transformer=diffusers.QwenImage21Transformer2DModel.from_pretrained(root / "transformer",
                                                                            torch_dtype=torch.float32),
        sample_sigmas=index.get("sample_sigmas"))


def images_processor(root: Path):
    """transformers' own Qwen3VLProcessor over the checkpoint's processor files, images only
    (tests.helpers.images_only_processor)."""
    import transformers
    return images_only_processor(transformers.Qwen3VLProcessor, Path(root) / "processor")


def load_images_pipeline(root: Path):
    """load_pipeline with the images processor (images_processor): the pipeline as it runs with condition images."""
    pipe = load_pipeline(root)
    pipe.processor = images_processor(root)
    return pipe
