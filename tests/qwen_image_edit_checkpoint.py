"""A tiny random Qwen-Image-Edit-2509 (Edit Plus) checkpoint in the real diffusers layout, made with diffusers' and
transformers' own classes (test-only: qic's code never imports them), and the pipeline that edits with it.

Layout as the hub's Qwen/Qwen-Image-Edit-2509: model_index.json (QwenImageEditPlusPipeline), scheduler/, tokenizer/,
processor/ (the tokenizer files, the chat template, the image processor's preprocessor_config.json: Qwen2.5-VL's
published settings), text_encoder/ (Qwen2_5_VLForConditionalGeneration with its vision tower: the tiny preset's
configs, qic.checkpoint.presets), transformer/ (QwenImageTransformer2DModel; `zero_cond_t` for 2511) and vae/
(AutoencoderKLQwenImage). The tokenizer is qic's embedded byte-level BPE (Qwen2's special tokens, so <|image_pad|>
and the chat markers are single tokens as in the real vocabulary).

The reference pipeline differs from diffusers' stock one in two ways, both stated where they are made:
- transformers' Qwen2VLProcessor needs a video processor, which needs torchvision (not installable here): the
  processor is made without that part (../shared/notes/qwen-image.md), its image part the PIL class;
- diffusers 0.42's edit pipelines do not pass `mm_token_type_ids`, so with transformers 5 their image tokens run
  at 1-D positions (diffusers issue 14194, PR 14189 open); the models were trained with the 3-D positions qic
  computes, and the reference's text encoder is given the argument.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qic.checkpoint.embedded import PREPROCESSOR_CONFIG, tokenizer_files
from qic.checkpoint.presets import preset, special_id
from tests.helpers import images_only_processor, sensitize_

# Qwen2-VL's chat template for what the processor renders (text parts only: the pipeline formats its own prompt)
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}")
INDEX = {"_class_name": "QwenImageEditPlusPipeline", "_diffusers_version": "0.36.0.dev0",
         "processor": ["transformers", "Qwen2VLProcessor"],
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
         "tokenizer": ["transformers", "Qwen2Tokenizer"],
         "transformer": ["diffusers", "QwenImageTransformer2DModel"],
         "vae": ["diffusers", "AutoencoderKLQwenImage"]}
# As the Qwen-Image parity checkpoints: a smaller last decoder conv keeps pixels off the +-1 clamp
VAE_CONV_OUT_SCALE = 0.3


def write_checkpoint(root: Path, seed: int = 0, zero_cond_t: bool = False,
                     pipeline: str = "QwenImageEditPlusPipeline") -> Path:
    """Write the checkpoint into `root` (created), weights re-drawn by tests.helpers.sensitize_ so that every weight
    shows in the image; `pipeline`: the model_index class (QwenImageEditPipeline: Qwen-Image-Edit's). Returns
    root."""
    import diffusers
    import transformers

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    configs = preset("tiny")
    torch.manual_seed(seed)
    te = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(**configs["text_encoder"]))
    sensitize_(te, seed=seed).save_pretrained(root / "text_encoder")
    transformer = diffusers.QwenImageTransformer2DModel.from_config(
        {**configs["transformer"], "zero_cond_t": zero_cond_t})
    sensitize_(transformer, seed=seed + 1).save_pretrained(root / "transformer")
    vae = sensitize_(diffusers.AutoencoderKLQwenImage.from_config(configs["vae"]), seed=seed + 2)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(VAE_CONV_OUT_SCALE)
    vae.save_pretrained(root / "vae")
    # the preset's config as written (diffusers adds its defaults' keys): the decoder's graph key is then the session
    # tiny checkpoint's, whose compiled decoder the edit bundle reuses (a compile cache hit, not a new graph)
    (root / "vae" / "config.json").write_text(json.dumps(configs["vae"], indent=2))
    diffusers.FlowMatchEulerDiscreteScheduler.from_config(configs["scheduler"]).save_pretrained(root / "scheduler")
    for folder in ("tokenizer", "processor"):
        (root / folder).mkdir(exist_ok=True)
        for name, data in tokenizer_files().items():
            (root / folder / name).write_bytes(data)
    (root / "processor" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (root / "model_index.json").write_text(json.dumps({**INDEX, "_class_name": pipeline}, indent=2))
    return root


def give_3d_positions(text_encoder) -> None:
    """The text encoder's forward given `mm_token_type_ids` (module docstring: why), otherwise itself."""
    forward, pad = text_encoder.forward, text_encoder.config.image_token_id

    def with_types(input_ids=None, **kw):
        return forward(input_ids=input_ids, mm_token_type_ids=(input_ids == pad).int(), **kw)
    text_encoder.forward = with_types


def load_pipeline(root: Path):
    """diffusers' pipeline of the checkpoint's class (QwenImageEditPlusPipeline, QwenImageEditPipeline), fp32 on
    CPU, each component by its class's own from_pretrained, with the images processor and the 3-D positions (module
    docstring)."""
    import diffusers
    import transformers

    root = Path(root)
    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=torch.float32)
    cls = getattr(diffusers, json.loads((root / "model_index.json").read_text())["_class_name"])
    pipe = cls(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=diffusers.AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=torch.float32),
        text_encoder=te,
        tokenizer=transformers.AutoTokenizer.from_pretrained(root / "tokenizer"),
        processor=images_only_processor(transformers.Qwen2VLProcessor, root / "processor"),
        transformer=diffusers.QwenImageTransformer2DModel.from_pretrained(root / "transformer",
                                                                          torch_dtype=torch.float32))
    give_3d_positions(te)
    return pipe


def image_token_id() -> int:
    return special_id("<|image_pad|>")
