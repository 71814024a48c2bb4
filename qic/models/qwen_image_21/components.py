"""Qwen-Image-2.1's compiled components, each one definition (qic.family.Component): text to image for now.

- text_encoder: the Qwen3-VL language model's prefill per text bucket (text only: no vision tower graph yet);
- denoiser: two graphs per resolution and text bucket, prefill and decode (qic.models.qwen_image_21.graphs);
- vae_decoder: per resolution, fp32 whatever the build's dtype (as Qwen-Image's).
The modules load diffusers' / transformers' tensor names strict, so the converters only select tensors (the
text encoder's language model, the VAE's decoder half). The TP tables are the modules' own TP_PLANs (the
denoiser's is diffusers' _tp_plan), applied at shard time: `--tp N` for any N dividing the heads and widths
(tests/test_qwen_image_21_tp.py). What is not wired yet is refused in validate() in one line each (Ulysses,
batches, step caching, exact-length text, condition images).
"""

from __future__ import annotations

from qic.errors import ConfigError
from qic.family import Component
from qic.host.schedule import check_scheduler_config
from qic.models.qwen_image_21.denoiser import TP_PLAN as DENOISER_TP
from qic.models.qwen_image_21.denoiser import DenoiserConfig, QwenImage21Denoiser, denoiser_state_dict
from qic.models.qwen_image_21.graphs import DECODE, PREFILL, denoiser_graph, text_encoder_graph, vae_decoder_graph
from qic.models.qwen_image_21.host.prompt import SYSTEM_MESSAGE, prompt_text
from qic.models.qwen_image_21.host.sampling import SIZE_MULTIPLE, VAE_SCALE
from qic.models.qwen_image_21.looped import LoopedQwenImage21Denoiser
from qic.models.qwen_image_21.text_encoder import TP_PLAN as TEXT_ENCODER_TP
from qic.models.qwen_image_21.text_encoder import (
    LoopedQwenImage21TextEncoder,
    QwenImage21TextEncoder,
    TextEncoder21Config,
    text_encoder_state_dict,
)
from qic.models.qwen_image_21.vae import QwenImage21VAEDecoder, VAE21Config, vae21_decoder_state_dict

_HERE = __name__.rpartition(".")[0]
_SHARED = ("qic.models.common", "qic.models.looped")
FAMILY = "Qwen-Image-2.1"


def _text_encoder_shapes(spec) -> list[dict]:
    return [{"bucket": b} for b in spec.text_buckets]


def _denoiser_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w], "bucket": b, "part": part}
            for h, w in spec.resolutions for b in spec.text_buckets for part in (PREFILL, DECODE)]


def _vae_decoder_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} for h, w in spec.resolutions]


def _text_encoder_graph(module, configs, shape, dtype, layout):
    return text_encoder_graph(module, shape["bucket"])


def _denoiser_graph(module, configs, shape, dtype, layout):
    return denoiser_graph(module, configs["denoiser"], *shape["resolution"], shape["bucket"], shape["part"], dtype)


def _vae_decoder_graph(module, configs, shape, dtype, layout):
    return vae_decoder_graph(module, *shape["resolution"])


def _text_encoder_module(config, tp_size: int = 1, looped: bool = False):
    # drop_tokens 0: the graph returns every row; the host drops the system tokens (the tokenizer decides how many)
    return (LoopedQwenImage21TextEncoder if looped else QwenImage21TextEncoder)(config, tp_size=tp_size)


def _denoiser_module(config, tp_size: int = 1, looped: bool = False):
    return (LoopedQwenImage21Denoiser if looped else QwenImage21Denoiser)(config, tp_size=tp_size)


def _vae_module(config, tp_size: int = 1, looped: bool = False):
    # The weights do not depend on the resolution: any valid one gives the tensor names and shapes.
    return QwenImage21VAEDecoder(config, 2 * config.scale_factor, 2 * config.scale_factor)


COMPONENTS: dict[str, Component] = {c.name: c for c in (
    Component("text_encoder", "text_encoder", TextEncoder21Config.from_dict, _text_encoder_module,
              text_encoder_state_dict, (f"{_HERE}.text_encoder", *_SHARED), _text_encoder_shapes,
              _text_encoder_graph, config_deps=("text_encoder",), tp_plan=TEXT_ENCODER_TP,
              blocks="model.language_model.layers", neuron_model_type="transformer"),
    Component("denoiser", "transformer", DenoiserConfig.from_dict, _denoiser_module, denoiser_state_dict,
              (f"{_HERE}.denoiser", f"{_HERE}.looped", *_SHARED), _denoiser_shapes, _denoiser_graph,
              config_deps=("transformer",), tp_plan=DENOISER_TP, blocks="transformer_blocks",
              neuron_model_type="transformer"),
    Component("vae_decoder", "vae", VAE21Config.from_dict, _vae_module, vae21_decoder_state_dict,
              (f"{_HERE}.vae", "qic.models.common"), _vae_decoder_shapes, _vae_decoder_graph,
              config_deps=("vae",), fixed_dtype="float32", neuron_model_type="unet-inference"),
)}


def _refuse(what: str, fix: str) -> None:
    raise ConfigError(f"{FAMILY}: {what}: not yet (text-to-image, TP and CFG-parallel)", fix)


def drop_tokens(tokenizer) -> int:
    """The system-message tokens the pipeline drops (its _drop_idx: the tokenized system message)."""
    return len(tokenizer.encode(SYSTEM_MESSAGE).ids)


def validate(spec, ctx) -> None:
    """What a 2.1 build can do today; everything else is one line naming it."""
    if spec.ulysses > 1:
        # Exact in principle: after its all-to-all each rank attends over the whole sequence for its heads, so the
        # block-causal mask applies unchanged; but the prefix and the target shard separately (each a multiple of
        # the degree) and the resident K/V would be head-sharded per Ulysses rank: not wired.
        _refuse(f"--ulysses {spec.ulysses} (exact under the block-causal mask, but its exchange is not wired)",
                "drop --ulysses; --tp and --cfg-parallel split 2.1")
    if spec.step_cache:
        _refuse("step caching", "drop step_cache")
    if tuple(spec.batch_sizes) != (1,):
        _refuse("batch sizes other than 1", "drop --batch-sizes")
    if 0 in spec.text_buckets:
        _refuse("exact-length text (bucket 0)", "give fixed text buckets, e.g. --text-buckets 128")
    if ctx.scheduler is None:
        ctx.ckpt.config("scheduler")      # a checkpoint without one: the reader's one line naming the file
    check_scheduler_config(ctx.scheduler)
    if ctx.tokenizer is None:
        from qic.tokenizer import load_tokenizer
        load_tokenizer(ctx.ckpt.tokenizer_dir)   # the tokenizer's own error naming what is missing
    vae = ctx.configs["vae_decoder"]
    if vae.scale_factor != VAE_SCALE:
        raise ConfigError(f"{FAMILY}: the VAE is {vae.scale_factor}x; the pipeline hard-codes {VAE_SCALE}x")
    if ctx.configs["denoiser"].in_channels != vae.z_dim or ctx.configs["denoiser"].patch_size != 1:
        raise ConfigError(f"{FAMILY}: transformer in_channels {ctx.configs['denoiser'].in_channels} must equal the "
                          f"VAE's z_dim {vae.z_dim}, with patch_size 1 (the pipeline's packing)")
    for h, w in spec.resolutions:
        if h % SIZE_MULTIPLE or w % SIZE_MULTIPLE:
            raise ConfigError(f"resolution {h}x{w}: {FAMILY} sizes are multiples of {SIZE_MULTIPLE}",
                              f"use e.g. {h // SIZE_MULTIPLE * SIZE_MULTIPLE or SIZE_MULTIPLE}x"
                              f"{w // SIZE_MULTIPLE * SIZE_MULTIPLE or SIZE_MULTIPLE}")
    if ctx.tokenizer is not None:
        need = len(ctx.tokenizer.encode(prompt_text(" ")).ids)
        for b in spec.text_buckets:
            if b < need:
                raise ConfigError(f"text bucket {b} is too small for {FAMILY}'s prompt template ({need} tokens with "
                                  "an empty prompt)", f"use buckets >= {need}")


def manifest_fields(spec, ctx) -> dict:
    """What the host program (qic.models.qwen_image_21.host) reads of a bundle beside its graphs."""
    vae = ctx.configs["vae_decoder"]
    index = _model_index(ctx)
    return {
        "resolutions": [list(r) for r in spec.resolutions],
        "text_buckets": list(spec.text_buckets),
        "prompt": {"drop_tokens": drop_tokens(ctx.tokenizer)},
        "scheduler": ctx.scheduler,
        "scheduler_overrides": dict(spec.scheduler),
        "sample_sigmas": index.get("sample_sigmas"),
        "latents": {"z_dim": vae.z_dim, "vae_scale_factor": VAE_SCALE},
        "denoiser": {"axes_dims_rope": list(ctx.configs["denoiser"].axes_dims_rope)},   # the host's RoPE tables
    }


def resident_state(spec, configs) -> list[tuple[str, int]]:
    """What the host program keeps between graph calls on one rank (qic plan): the prefix K/V cache of the largest
    (resolution, bucket) a request can use, [layers, 1, heads on this rank, bucket, head_dim] for K and for V, for
    each CFG branch this rank runs (both, unless CFG-parallel gives each group one). The target's resolution does
    not change it: the prefix is the text."""
    from qic.dtypes import TORCH_DTYPES
    if "denoiser" not in spec.components:
        return []
    c = configs["denoiser"]
    heads = c.num_attention_heads // spec.tp
    item = TORCH_DTYPES[spec.dtype_of("denoiser")].itemsize
    per_branch = 2 * c.num_layers * heads * max(spec.text_buckets) * c.attention_head_dim * item
    branches = 1 if spec.layout.cfg > 1 or True not in spec.cfg else 2
    what = "prefix K/V cache (" + ("one CFG branch a group" if spec.layout.cfg > 1 else
                                    f"{branches} CFG branch{'es' if branches > 1 else ''}") + \
        f", text bucket {max(spec.text_buckets)})"
    return [(what, branches * per_branch)]


def _model_index(ctx) -> dict:
    import json
    return json.loads((ctx.ckpt.root / "model_index.json").read_text())
