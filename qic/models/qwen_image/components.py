"""Qwen-Image's compiled components, each one definition (qic.family.Component): the only place that says what
the text encoder, the denoiser and the VAE decoder are to a build, and for editing (a build with condition sizes:
the Edit Plus models) the vision tower and the VAE encoder. An edit build's text encoder and denoiser graphs are
the images forms only (graphs.py): an Edit Plus model always reads at least one condition image.

The TP tables (Megatron-style): Q/K/V and MLP up-projections split by rows (heads / hidden units stay
contiguous), output and down projections split by columns and are reduced inside the graph (RowLinear) before
their bias is added, so biases of row-parallel layers stay whole on every rank. Projections whose small output
every rank needs whole (the denoiser's per-block modulation, its output-norm and text-input projections) split
by rows and are all-gathered (GatherLinear); the timestep embedder is a column/row pair; the text encoder's
token embedding splits by vocabulary rows (VocabEmbedding: masked lookup, then an all_reduce sum), padded to
ceil(V / tp) rows a rank (fine-tunes add tokens, e.g. 401 rows), the surplus rows (the last rank's) zeros that
no token id reaches. What stays whole: norms, row-parallel biases, the thin img_in / proj_out (64 latent
channels wide), and the whole VAE decoder. Every other split tensor must divide (heads, MLP width: the model
refuses). The modules' constructors state the same split as per-rank sizes (`// tp_size`); stage 1 checks the
two agree tensor by tensor (qic.builder.shard._plan), so a table that disagrees with its model fails the build.
"""

from __future__ import annotations

from qic.errors import ConfigError, warn
from qic.family import COLUMN, ROW, Component, TPPlan
from qic.host.image_tokens import IMAGE_PAD
from qic.host.latents import check_resolution
from qic.host.prompt import DROP_TOKENS, EDIT_DROP_TOKENS, MAX_PROMPT_TOKENS, TEMPLATE, edit_prompt_text
from qic.host.schedule import check_scheduler_config
from qic.host.vl_processor import QWEN2_5_VL, image_processor_settings
from qic.models.qwen_image.graphs import (
    IMAGES,
    SAMPLE,
    denoiser_graph,
    denoiser_images_graph,
    step_part_graph,
    text_encoder_graph,
    text_encoder_images_graph,
    vae_decoder_graph,
    vae_encoder_graph,
    vision_graph,
)
from qic.models.qwen_image.host.conditions import LATENT_PATCH, PLUS, V1, VISION_AREA, built_grid, slots
from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT, mmdit_state_dict
from qic.models.qwen_image.text_encoder import (
    LoopedTextEncoder,
    QwenTextEncoder,
    TextEncoderConfig,
    text_encoder_state_dict,
)
from qic.models.qwen_image.vae_decoder import QwenVAEDecoder, VAEConfig, vae_decoder_state_dict
from qic.models.qwen_image.vae_encoder import QwenVAEEncoder, vae_encoder_state_dict
from qic.models.qwen_image.vision import QwenImageVision, VisionConfig, vision_state_dict
from qic.spec import model_class

_HERE = __name__.rpartition(".")[0]                     # this family's package
_SHARED = ("qic.models.common", "qic.models.looped")     # the shared modules its converted weights depend on


def _batches(spec) -> list[dict]:
    # Batch 1 and the CFG graph have no "batch" / "cfg" entry: their names and spec keys predate them.
    return [{} if n == 1 else {"batch": n} for n in spec.batch_sizes]


# The pipelines an edit build (condition sizes) reads, and how each sizes its vision inputs (host/conditions.py)
EDIT_CLASSES = {"QwenImageEditPlusPipeline": PLUS, "QwenImageEditPipeline": V1}


def edit_kind(spec) -> str:
    return EDIT_CLASSES.get(spec.pipeline_class, PLUS)


def _edit(spec) -> dict:
    """How the shapes of an edit build's graphs size vision inputs: Edit's kind (Edit Plus's shapes name no kind, the
    first built), and a model's own vision-side area where it records one (spec.condition_areas)."""
    if edit_kind(spec) == V1:
        return {"edit": V1}
    area = _vision_area(spec)
    return {} if area == VISION_AREA else {"vision_area": area}


def _vision_area(spec) -> int:
    """The vision-side area an Edit Plus build sizes condition images to: the model's own, else the pipeline's."""
    return spec.condition_areas[1] if spec.condition_areas else VISION_AREA


def _conditions(spec) -> dict:
    """An edit build's condition capacity, as its images forms' shapes record it (the graph makers derive the
    slots from it and the configs)."""
    return {"conditions": [list(s) for s in spec.condition_sizes], "images": spec.condition_images} | _edit(spec)


def _text_encoder_shapes(spec) -> list[dict]:
    if spec.condition_sizes:
        return [{"bucket": b, "part": IMAGES} | _conditions(spec) for b in spec.text_buckets]
    return [{"bucket": b} | n for n in _batches(spec) for b in spec.text_buckets]


def _denoiser_shapes(spec) -> list[dict]:
    if spec.condition_sizes:
        return [{"resolution": [h, w], "bucket": b} | ({} if guided else {"cfg": False}) | {"part": IMAGES}
                | _conditions(spec) for h, w in spec.resolutions for b in spec.text_buckets for guided in spec.cfg]
    steps = [{"resolution": [h, w], "bucket": b} | ({} if guided else {"cfg": False}) | n
             for n in _batches(spec) for h, w in spec.resolutions for b in spec.text_buckets for guided in spec.cfg]
    if not spec.step_cache:
        return steps
    return steps + [s for step in steps for s in step_part_shapes(step, *spec.step_cache, spec.cfg_parallel)]


def step_part_shapes(step: dict, first: int, last: int, cfg_parallel: bool = False) -> list[dict]:
    """The split graphs of one step graph's shape: head, rest (the middle and the tail over all rows: a step
    that computes), mixed (when there is more than one row: one row's middle and every row's tail, a step where
    that row computes and the others cache), mid over one row (more than two rows: several computing while others
    cache, each row's middle before the tail), tail (a step that caches, or after those rows). Under CFG-parallel a
    rank's rows are its branch's: one per image."""
    guided = step.get("cfg", True)
    rows = (2 if guided and not cfg_parallel else 1) * step.get("batch", 1)
    parts = [{"part": "head"}, {"part": "rest"}] + ([{"part": "mixed", "rows": 1}] if rows > 1 else [])
    parts += [{"part": "mid", "rows": 1}] if rows > 2 else []   # several rows computing while others cache
    parts.append({"part": "tail"})
    return [step | {"first": first, "last": last} | p for p in parts]


def _vae_decoder_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} | n for n in _batches(spec) for h, w in spec.resolutions]


def _condition_shapes(spec) -> list[dict]:
    return [{"resolution": [h, w]} | _edit(spec) for h, w in spec.condition_sizes]


def grid_settings(vision: VisionConfig) -> dict:
    """The processor settings a build derives vision grids with: the tower's patch and merge sizes, Qwen2.5-VL's
    pixel bounds (validate checks the checkpoint's processor gives every built size the same grid)."""
    return {**QWEN2_5_VL, "patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size}


def _capacity(configs, shape) -> tuple[int, int]:
    """(vision-token slots, condition latent tokens) of an images form's shape."""
    return slots([tuple(s) for s in shape["conditions"]], shape["images"], grid_settings(configs["vision"]),
                 shape.get("edit", PLUS), shape.get("vision_area", VISION_AREA))


def _text_encoder_graph(module, configs, shape, dtype, layout):
    if shape.get("part") == IMAGES:
        return text_encoder_images_graph(module, shape["bucket"], _capacity(configs, shape)[0], dtype)
    return text_encoder_graph(module, shape["bucket"], shape.get("batch", 1))


def _vision_graph(module, configs, shape, dtype, layout):
    size = tuple(shape["resolution"])
    grid = built_grid(size, grid_settings(configs["vision"]), shape.get("edit", PLUS),
                      shape.get("vision_area", VISION_AREA))
    return vision_graph(module, *size, grid, dtype)


def _vae_encoder_shapes(spec) -> list[dict]:
    """An edit build's condition sizes; else (the component named in a text-to-image build) img2img's and
    inpaint's sample form at each output resolution."""
    if spec.condition_sizes:
        return _condition_shapes(spec)
    return [{"resolution": [h, w], "part": SAMPLE} for h, w in spec.resolutions]


def _vae_encoder_graph(module, configs, shape, dtype, layout):
    return vae_encoder_graph(module, *shape["resolution"], sample=shape.get("part") == SAMPLE)


def _denoiser_graph(module, configs, shape, dtype, layout):
    (h, w), scale = shape["resolution"], configs["vae_decoder"].scale_factor
    if shape.get("part") == IMAGES:
        n_slots, cond_tokens = _capacity(configs, shape)
        return denoiser_images_graph(module, configs["denoiser"], scale, h, w, shape["bucket"], dtype, n_slots,
                                     cond_tokens, cfg=shape.get("cfg", True), layout=layout)
    common = dict(cfg=shape.get("cfg", True), batch=shape.get("batch", 1), layout=layout)
    if "part" in shape:
        return step_part_graph(module, configs["denoiser"], scale, h, w, shape["bucket"], dtype, shape["part"],
                               shape["first"], shape["last"], rows=shape.get("rows"), **common)
    return denoiser_graph(module, configs["denoiser"], scale, h, w, shape["bucket"], dtype, **common)


def _vae_decoder_graph(module, configs, shape, dtype, layout):
    return vae_decoder_graph(module, *shape["resolution"], shape.get("batch", 1))


def _text_encoder_module(config: TextEncoderConfig, tp_size: int = 1, looped: bool = False):
    return (LoopedTextEncoder if looped else QwenTextEncoder)(config, tp_size=tp_size)


def _denoiser_module(config: MMDiTConfig, tp_size: int = 1, looped: bool = False):
    return (LoopedMMDiT if looped else QwenMMDiT)(config, tp_size=tp_size)


def _vae_module(config: VAEConfig, tp_size: int = 1, looped: bool = False):
    # Weights do not depend on the resolution; any valid one gives the module's tensor names and shapes.
    step = 2 * config.scale_factor
    return QwenVAEDecoder(config, step, step)


def _vae_encoder_module(config: VAEConfig, tp_size: int = 1, looped: bool = False):
    step = 2 * config.scale_factor
    return QwenVAEEncoder(config, step, step)


def _vision_module(config: VisionConfig, tp_size: int = 1, looped: bool = False):
    return QwenImageVision(config)


_TEXT_ENCODER_TP = TPPlan(
    rules=(
        (r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
        (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ROW),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", COLUMN),
        (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ROW),
        (r"model\.embed_tokens\.weight", COLUMN),
    ),
    rank_tensors={"model.embed_tokens.vocab_start": ("model.embed_tokens.weight", COLUMN)},
    padded=("model.embed_tokens.weight",),
)
_DENOISER_TP = TPPlan(rules=(
    (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.(weight|bias)", COLUMN),
    (r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)\.weight", ROW),
    (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj\.(weight|bias)", COLUMN),
    (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.2\.weight", ROW),
    (r"transformer_blocks\.\d+\.(img|txt)_mod\.1\.(weight|bias)", COLUMN),
    (r"(norm_out\.linear|txt_in|time_text_embed\.timestep_embedder\.linear_1)\.(weight|bias)", COLUMN),
    (r"time_text_embed\.timestep_embedder\.linear_2\.weight", ROW),
))

# neuronx-cc model types as NxDI compiles transformers and the Flux VAE decoder (qic/backends/neuron/cc.py).
COMPONENTS: dict[str, Component] = {c.name: c for c in (
    Component("text_encoder", "text_encoder", TextEncoderConfig.from_dict, _text_encoder_module,
              text_encoder_state_dict, (f"{_HERE}.text_encoder", *_SHARED),
              _text_encoder_shapes, _text_encoder_graph, config_deps=("text_encoder",), tp_plan=_TEXT_ENCODER_TP,
              blocks="model.layers", neuron_model_type="transformer"),
    # The denoiser step packs latents by the VAE's scale, and an edit step's vision-token slots follow the vision
    # tower's patch and merge sizes (the text encoder's folder): those configs key its graphs too.
    Component("denoiser", "transformer", MMDiTConfig.from_dict, _denoiser_module, mmdit_state_dict,
              (f"{_HERE}.mmdit", *_SHARED), _denoiser_shapes, _denoiser_graph,
              config_deps=("transformer", "vae", "text_encoder"), tp_plan=_DENOISER_TP, blocks="transformer_blocks",
              runs_layout=True, lora_target=True, neuron_model_type="transformer"),
    # The VAE decoder runs in fp32 whatever the build's dtype (bf16 decoding visibly bands images).
    Component("vae_decoder", "vae", VAEConfig.from_dict, _vae_module, vae_decoder_state_dict,
              (f"{_HERE}.vae_decoder", "qic.models.common"), _vae_decoder_shapes, _vae_decoder_graph,
              config_deps=("vae",), fixed_dtype="float32", neuron_model_type="unet-inference"),
    # Editing's condition components (a build with condition sizes), replicated under TP: the Qwen2.5-VL vision
    # tower (its weights in the text encoder's folder, visual.*) and the VAE's encoder half, fp32 as the decoder.
    Component("vision", "text_encoder", VisionConfig.from_dict, _vision_module, vision_state_dict,
              (f"{_HERE}.vision", *_SHARED), _condition_shapes, _vision_graph, config_deps=("text_encoder",),
              neuron_model_type="transformer", conditions=True),
    # Named in a text-to-image build's components (opt_in), the VAE encoder serves img2img and inpaint instead.
    Component("vae_encoder", "vae", VAEConfig.from_dict, _vae_encoder_module, vae_encoder_state_dict,
              (f"{_HERE}.vae_encoder", f"{_HERE}.vae_decoder", "qic.models.common"), _vae_encoder_shapes,
              _vae_encoder_graph, config_deps=("vae",), fixed_dtype="float32", neuron_model_type="unet-inference",
              conditions=True, opt_in=True),
)}


def validate(spec, ctx) -> None:
    """Qwen-Image's checks of a build (qic.builder.context.validate calls them first): its scheduler, resolutions
    (the VAE's scale), text buckets against the prompt template, the denoiser's heads under a parallel layout."""
    if ctx.scheduler is None:
        ctx.ckpt.config("scheduler")      # a checkpoint without one: the reader's one line naming the file
    if ctx.tokenizer is None and not ctx.configs_only:
        from qic.tokenizer import load_tokenizer
        load_tokenizer(ctx.ckpt.tokenizer_dir)   # the tokenizer's own error naming what is missing
    check_scheduler_config(ctx.scheduler)
    vae = ctx.configs["vae_decoder"]
    for h, w in spec.resolutions:
        check_resolution(h, w, vae.scale_factor)
    if ctx.tokenizer is not None:
        template_len = len(ctx.tokenizer.encode(TEMPLATE.format("")).ids)
        what = f"the prompt template ({template_len} tokens with an empty prompt)"
    else:
        # Configs without a tokenizer (e.g. the published Qwen-Image configs): the template's length is
        # unknown, but the encoder output drops its first DROP_TOKENS, so a bucket must exceed that for
        # the denoiser's graphs to exist at all. The build with the tokenizer checks the exact bound.
        template_len, what = DROP_TOKENS, f"the {DROP_TOKENS} template tokens the denoiser drops"
        if any(spec.text_buckets):
            warn(f"{ctx.ckpt.root}: no tokenizer, so text buckets are checked only against the {DROP_TOKENS} "
                 "dropped template tokens, not the template's full length (a build with the tokenizer checks it)")
    for b in spec.text_buckets:
        if b and b <= template_len:
            raise ConfigError(f"text bucket {b} is too small for {what}; use buckets > {template_len}")
    if "denoiser" in spec.components and not spec.layout.plain:
        from qic.parallel.sequence import check_layout
        check_layout(spec.layout, ctx.configs["denoiser"].num_attention_heads)
    _check_edit(spec, ctx)


def _check_edit(spec, ctx) -> None:
    """An edit build: an Edit Plus checkpoint with condition sizes, and what its graphs do not take yet refused."""
    # the spec's reading of model_index.json, else (an embedded checkpoint, written since) the resolved folder's
    cls = spec.pipeline_class or model_class(str(ctx.ckpt.root))
    edit = cls in EDIT_CLASSES
    if edit and not spec.condition_sizes:
        raise ConfigError(f"{ctx.ckpt.root}: {cls} edits condition images: its build needs their sizes",
                          "add --condition-size HxW (the VAE side of a condition image, e.g. 1024x1024), repeatable")
    if not spec.condition_sizes:
        return
    if not edit:
        raise ConfigError(f"{ctx.ckpt.root}: {cls} takes no condition images; condition sizes need an Edit "
                          f"checkpoint ({', '.join(EDIT_CLASSES)})", "drop --condition-size")
    if EDIT_CLASSES[cls] == V1 and spec.condition_images != 1:
        raise ConfigError(f"{cls} reads one condition image; --condition-images {spec.condition_images}",
                          "drop --condition-images (Edit Plus checkpoints take several)")
    for what, bad in (("--batch-sizes other than 1", tuple(spec.batch_sizes) != (1,)),
                      ("step caching", bool(spec.step_cache)), (f"--ulysses {spec.ulysses}", spec.ulysses > 1),
                      ("exact-length text (bucket 0)", 0 in spec.text_buckets)):
        if bad:
            raise ConfigError(f"an edit build (condition sizes) with {what}: not yet", f"drop {what.split(' ')[0]}")
    for h, w in spec.condition_sizes:
        if h % (2 * LATENT_PATCH) or w % (2 * LATENT_PATCH):
            raise ConfigError(f"condition size {h}x{w}: the Edit pipelines resize condition images to multiples of "
                              f"{2 * LATENT_PATCH}", f"use e.g. {max(32, h // 32 * 32)}x{max(32, w // 32 * 32)}")
    vision, text = ctx.configs["vision"], ctx.configs["text_encoder"]
    proc = image_processor_settings(ctx.ckpt.root / "processor", QWEN2_5_VL)
    if (proc["patch_size"], proc["merge_size"]) != (vision.patch_size, vision.spatial_merge_size):
        raise ConfigError(f"{ctx.ckpt.root / 'processor'}: the image processor's patch/merge sizes "
                          f"{proc['patch_size']}/{proc['merge_size']} differ from the vision tower's "
                          f"{vision.patch_size}/{vision.spatial_merge_size}")
    area = _vision_area(spec)
    for size in spec.condition_sizes:
        kind = EDIT_CLASSES[cls]
        if built_grid(size, proc, kind, area) != built_grid(size, grid_settings(vision), kind, area):
            raise ConfigError(f"condition size {size[0]}x{size[1]}: the checkpoint's image processor bounds its "
                              f"pixels ({proc['min_pixels']}..{proc['max_pixels']}) so that the vision grid is not the "
                              "published processor's", "use a condition size within those bounds")
    if ctx.tokenizer is not None:
        pad = ctx.tokenizer.token_to_id(IMAGE_PAD)
        if pad != text.image_token_id:
            raise ConfigError(f"{ctx.ckpt.tokenizer_dir}: the tokenizer's {IMAGE_PAD} is {pad}; the text encoder's "
                              f"config says image_token_id {text.image_token_id}")
        n = spec.condition_images
        need = len(ctx.tokenizer.encode(edit_prompt_text(" ", n, EDIT_CLASSES[cls] == PLUS)).ids) - n   # less the pads
        for b in spec.text_buckets:
            if b < max(need, EDIT_DROP_TOKENS + 1):
                raise ConfigError(f"text bucket {b} is too small for the edit template with {n} picture(s) ({need} "
                                  "tokens with an empty prompt)", f"use buckets >= {need}")


def manifest_fields(spec, ctx) -> dict:
    """What Qwen-Image's host programs (qic.runtime.generate; editing's, qic.models.qwen_image.host) read of a
    bundle beside its graphs."""
    vae, den = ctx.configs["vae_decoder"], ctx.configs["denoiser"]
    edit = {}
    if spec.condition_sizes:
        proc = image_processor_settings(ctx.ckpt.root / "processor", QWEN2_5_VL)
        kind = edit_kind(spec)
        area = _vision_area(spec)
        n_slots, cond_tokens = slots(spec.condition_sizes, spec.condition_images, proc, kind, area)
        edit = {"prompt": {"drop_tokens": EDIT_DROP_TOKENS, "max_tokens": MAX_PROMPT_TOKENS},
                "conditions": {"edit": kind, "sizes": [list(s) for s in spec.condition_sizes],
                               "images": spec.condition_images,
                               "grids": [list(built_grid(s, proc, kind, area)) for s in spec.condition_sizes],
                               "slots": n_slots, "cond_tokens": cond_tokens, "processor": proc,
                               "image_token_id": ctx.configs["text_encoder"].image_token_id}
                | ({"areas": list(spec.condition_areas)} if spec.condition_areas else {}),
                "denoiser": {"axes_dims_rope": list(den.axes_dims_rope)}}
    return {
        "resolutions": [list(r) for r in spec.resolutions],
        "text_buckets": list(spec.text_buckets),
        "cfg": list(spec.cfg) if "denoiser" in spec.components else [],  # step graphs: True CFG, False no-CFG
        "batch_sizes": list(spec.batch_sizes),           # images per graph call the graphs exist for
        "prompt": {"template": TEMPLATE, "drop_tokens": DROP_TOKENS, "max_tokens": MAX_PROMPT_TOKENS},
        "scheduler": ctx.scheduler,                       # the checkpoint's, overrides applied
        "scheduler_overrides": dict(spec.scheduler),
        # Step caching's split graphs are in: blocks always computed first and last
        # (qic/models/qwen_image/step_cache.py)
        "step_cache": dict(zip(("first", "last"), spec.step_cache)) if spec.step_cache else None,
        # img2img and inpaint: the VAE encoder's sample form at every resolution (qic.runtime.generate)
        "img2img": "vae_encoder" in spec.components and not spec.condition_sizes,
        "latents": {"z_dim": vae.z_dim, "vae_scale_factor": vae.scale_factor, "channels": den.in_channels,
                    "latents_mean": list(vae.latents_mean), "latents_std": list(vae.latents_std)},
    } | edit
