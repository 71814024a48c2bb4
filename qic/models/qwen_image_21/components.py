"""Qwen-Image-2.1's compiled components, each one definition (qic.family.Component): text to image for now.

- text_encoder: the Qwen3-VL language model's prefill per text bucket (text only: no vision tower graph yet);
- denoiser: two graphs per resolution and text bucket, prefill and decode (qic.models.qwen_image_21.graphs);
- vae_decoder: per resolution, fp32 whatever the build's dtype (as Qwen-Image's);
- vision, vae_encoder: the condition components, per condition size (`--condition-size`), in a build only when it
  names condition sizes: the Qwen3-VL vision tower (replicated under TP, its weights in the text encoder's folder)
  and the VAE's encoder half (fp32).
The modules load diffusers' / transformers' tensor names strict, so the converters only select tensors (the
text encoder's language model, the VAE's decoder half). The TP tables are the modules' own TP_PLANs (the
denoiser's is diffusers' _tp_plan), applied at shard time: `--tp N` for any N dividing the heads and widths
(tests/test_qwen_image_21_tp.py). What is not wired yet is refused in validate() in one line each (Ulysses,
batches, step caching, exact-length text).
"""

from __future__ import annotations

from qic.errors import ConfigError
from qic.family import Component
from qic.host.condition_images import vision_grid
from qic.host.image_tokens import IMAGE_PAD
from qic.host.schedule import check_scheduler_config
from qic.host.vl_processor import QWEN3_VL, image_processor_settings
from qic.models.qwen_image_21.denoiser import TP_PLAN as DENOISER_TP
from qic.models.qwen_image_21.denoiser import DenoiserConfig, QwenImage21Denoiser, denoiser_state_dict
from qic.models.qwen_image_21.graphs import (
    DECODE,
    DECODE_IMAGES,
    IMAGES,
    PREFILL,
    PREFILL_IMAGES,
    condition_grid,
    denoiser_graph,
    text_encoder_graph,
    vae_decoder_graph,
    vae_encoder_graph,
    vision_graph,
)
from qic.models.qwen_image_21.host.prompt import SYSTEM_MESSAGE, prompt_text
from qic.models.qwen_image_21.host.sampling import SIZE_MULTIPLE, VAE_SCALE
from qic.models.qwen_image_21.host.sequence import SLOT_TOKENS, prefix_sizes
from qic.models.qwen_image_21.looped import LoopedQwenImage21Denoiser
from qic.models.qwen_image_21.text_encoder import TP_PLAN as TEXT_ENCODER_TP
from qic.models.qwen_image_21.text_encoder import (
    LoopedQwenImage21TextEncoder,
    QwenImage21TextEncoder,
    TextEncoder21Config,
    text_encoder_state_dict,
)
from qic.models.qwen_image_21.vae import (
    QwenImage21VAEDecoder,
    QwenImage21VAEEncoder,
    VAE21Config,
    vae21_decoder_state_dict,
    vae21_encoder_state_dict,
)
from qic.models.qwen_image_21.vision import BLOCK_PREFIX as VISION_BLOCKS
from qic.models.qwen_image_21.vision import LoopedQwenImage21Vision, QwenImage21Vision, VisionConfig, vision_state_dict

_HERE = __name__.rpartition(".")[0]
_SHARED = ("qic.models.common", "qic.models.looped")
FAMILY = "Qwen-Image-2.1"


def condition_slots(spec) -> int:
    """The image slots a request's condition images may fill: --condition-images of the largest condition size
    (one <|image_pad|> token per 2x2 latent tokens of the 16x VAE, as many as the tower's merged tokens)."""
    if not spec.condition_sizes:
        return 0
    return spec.condition_images * max(h * w for h, w in spec.condition_sizes) // (VAE_SCALE ** 2 * SLOT_TOKENS)


def _text_encoder_shapes(spec) -> list[dict]:
    slots = condition_slots(spec)
    return [{"bucket": b} for b in spec.text_buckets] + \
        [{"bucket": b, "part": IMAGES, "slots": slots} for b in spec.text_buckets if slots]


def _denoiser_shapes(spec) -> list[dict]:
    slots = condition_slots(spec)
    parts = (PREFILL, DECODE) + ((PREFILL_IMAGES, DECODE_IMAGES) if slots else ())
    return [{"resolution": [h, w], "bucket": b, "part": part} | ({"slots": slots} if "-" in part else {})
            for h, w in spec.resolutions for b in spec.text_buckets for part in parts]


def _vae_decoder_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} for h, w in spec.resolutions]


def _condition_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} for h, w in spec.condition_sizes]


def _vision_graph(module, configs, shape, dtype, layout):
    return vision_graph(module, *shape["resolution"], dtype)


def _vae_encoder_graph(module, configs, shape, dtype, layout):
    return vae_encoder_graph(module, *shape["resolution"])


def _text_encoder_graph(module, configs, shape, dtype, layout):
    return text_encoder_graph(module, shape["bucket"], shape.get("slots", 0), dtype)


def _denoiser_graph(module, configs, shape, dtype, layout):
    return denoiser_graph(module, configs["denoiser"], *shape["resolution"], shape["bucket"], shape["part"], dtype,
                          shape.get("slots", 0))


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


def _vae_encoder_module(config, tp_size: int = 1, looped: bool = False):
    return QwenImage21VAEEncoder(config, 2 * config.scale_factor, 2 * config.scale_factor)


def _vision_module(config, tp_size: int = 1, looped: bool = False):
    return (LoopedQwenImage21Vision if looped else QwenImage21Vision)(config)


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
    Component("vision", "text_encoder", VisionConfig.from_dict, _vision_module, vision_state_dict,
              (f"{_HERE}.vision", *_SHARED), _condition_shapes, _vision_graph, config_deps=("text_encoder",),
              blocks=VISION_BLOCKS, neuron_model_type="transformer", conditions=True),
    Component("vae_encoder", "vae", VAE21Config.from_dict, _vae_encoder_module, vae21_encoder_state_dict,
              (f"{_HERE}.vae", "qic.models.common"), _condition_shapes, _vae_encoder_graph, config_deps=("vae",),
              fixed_dtype="float32", neuron_model_type="unet-inference", conditions=True),
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
    _check_conditions(spec, ctx)
    if ctx.tokenizer is not None:
        need = len(ctx.tokenizer.encode(prompt_text(" ")).ids)
        for b in spec.text_buckets:
            if b < need:
                raise ConfigError(f"text bucket {b} is too small for {FAMILY}'s prompt template ({need} tokens with "
                                  "an empty prompt)", f"use buckets >= {need}")


def _check_conditions(spec, ctx) -> None:
    """Condition sizes the pipeline can produce (multiples of 32) whose vision tokens are their image slots: the
    processor's smart resize must keep the size (else the text holds more or fewer slots than the latents fill,
    which the pipeline refuses too), with the tower's own patch and merge sizes."""
    if not spec.condition_sizes:
        return
    proc = image_processor_settings(ctx.ckpt.tokenizer_dir, QWEN3_VL)
    vision = ctx.configs.get("vision")
    text = ctx.configs.get("text_encoder")
    if ctx.tokenizer is not None and text is not None:
        pad = ctx.tokenizer.token_to_id(IMAGE_PAD)
        if pad != text.image_token_id:
            raise ConfigError(f"{ctx.ckpt.tokenizer_dir}: the tokenizer's {IMAGE_PAD} is {pad}; the text encoder's "
                              f"config says image_token_id {text.image_token_id}")
    for h, w in spec.condition_sizes:
        if h % SIZE_MULTIPLE or w % SIZE_MULTIPLE:
            raise ConfigError(f"condition size {h}x{w}: {FAMILY} resizes condition images to multiples of "
                              f"{SIZE_MULTIPLE}", f"use e.g. {max(SIZE_MULTIPLE, h // SIZE_MULTIPLE * SIZE_MULTIPLE)}x"
                              f"{max(SIZE_MULTIPLE, w // SIZE_MULTIPLE * SIZE_MULTIPLE)}")
        if vision is None:
            continue
        if (proc["patch_size"], proc["merge_size"]) != (vision.patch_size, vision.spatial_merge_size):
            raise ConfigError(f"{ctx.ckpt.tokenizer_dir}: the image processor's patch/merge sizes "
                              f"{proc['patch_size']}/{proc['merge_size']} differ from the vision tower's "
                              f"{vision.patch_size}/{vision.spatial_merge_size}")
        grid = vision_grid(h, w, proc["patch_size"], proc["merge_size"], proc["min_pixels"], proc["max_pixels"])
        if grid != condition_grid(vision, h, w):
            p = proc["patch_size"]
            raise ConfigError(f"condition size {h}x{w}: the image processor resizes it to {grid[0] * p}x{grid[1] * p} "
                              f"(its pixel bounds {proc['min_pixels']}..{proc['max_pixels']}), so its vision tokens "
                              "would not be its latents' image slots", "use a condition size within those bounds")


def manifest_fields(spec, ctx) -> dict:
    """What the host program (qic.models.qwen_image_21.host) reads of a bundle beside its graphs."""
    vae = ctx.configs["vae_decoder"]
    index = _model_index(ctx)
    processor = image_processor_settings(ctx.ckpt.tokenizer_dir, QWEN3_VL) if spec.condition_sizes else None
    return {
        "resolutions": [list(r) for r in spec.resolutions],
        "text_buckets": list(spec.text_buckets),
        "prompt": {"drop_tokens": drop_tokens(ctx.tokenizer)},
        "scheduler": ctx.scheduler,
        "scheduler_overrides": dict(spec.scheduler),
        "sample_sigmas": index.get("sample_sigmas"),
        "latents": {"z_dim": vae.z_dim, "vae_scale_factor": VAE_SCALE},
        "denoiser": {"axes_dims_rope": list(ctx.configs["denoiser"].axes_dims_rope)},   # the host's RoPE tables
        # the condition images a request may hold, and how the host resizes and normalises them for the tower
        "conditions": {"sizes": [list(s) for s in spec.condition_sizes], "images": spec.condition_images,
                       "slots": condition_slots(spec), "image_token_id": ctx.configs["text_encoder"].image_token_id,
                       "processor": processor},
    }


def resident_state(spec, configs) -> list[tuple[str, int]]:
    """What the host program keeps between graph calls on one rank (qic plan): the prefix K/V cache of the largest
    (resolution, bucket) a request can use, [layers, 1, heads on this rank, bucket, head_dim] for K and for V, for
    each CFG branch this rank runs (both, unless CFG-parallel gives each group one). The target's resolution does
    not change it: the prefix is the text, and with condition images their tokens too (graphs.prefix_sizes)."""
    from qic.dtypes import TORCH_DTYPES
    if "denoiser" not in spec.components:
        return []
    c = configs["denoiser"]
    heads = c.num_attention_heads // spec.tp
    item = TORCH_DTYPES[spec.dtype_of("denoiser")].itemsize
    slots = condition_slots(spec)
    prefix = prefix_sizes(max(spec.text_buckets), slots)[2]
    per_branch = 2 * c.num_layers * heads * prefix * c.attention_head_dim * item
    branches = 1 if spec.layout.cfg > 1 or True not in spec.cfg else 2
    what = "prefix K/V cache (" + ("one CFG branch a group" if spec.layout.cfg > 1 else
                                    f"{branches} CFG branch{'es' if branches > 1 else ''}") + \
        f", text bucket {max(spec.text_buckets)}" + \
        (f" + {spec.condition_images} condition image{'s' if spec.condition_images > 1 else ''}: {prefix} tokens"
         if slots else "") + ")"
    return [(what, branches * per_branch)]


def _model_index(ctx) -> dict:
    import json
    return json.loads((ctx.ckpt.root / "model_index.json").read_text())
