"""What a build knows before it does any work: the checkpoint, its configs, the tokenizer, the LoRAs, and every
error that can be found by looking (validate). Shared by `qic build` and `qic warm`."""

from __future__ import annotations

from pathlib import Path

from qic import family
from qic.builder.components import expected_tensors
from qic.builder.lora import load_lora
from qic.builder.source import resolve_model
from qic.errors import ConfigError, warn
from qic.host.latents import check_resolution
from qic.host.prompt import DROP_TOKENS, TEMPLATE
from qic.host.schedule import check_scheduler_config, merge_scheduler
from qic.spec import BuildSpec
from qic.tokenizer import load_tokenizer


class Context:
    """What validation derived, shared by the stages.

    configs_only: the checkpoint may hold configs (and a tokenizer) without weights, as `qic warm`
    compiles from; weights are then stood in by tensors of the right shapes (qic.builder.binding).
    """

    def __init__(self, spec: BuildSpec, progress, configs_only: bool = False):
        self.spec, self.progress, self.configs_only = spec, progress, configs_only
        self.cache = Path(spec.cache_dir)
        self.output = Path(spec.output)
        self.ckpt = resolve_model(spec.model, self.cache, configs_only=configs_only)
        self.raw = {f: self.ckpt.config(f) for f in family.folders()}
        self.scheduler = merge_scheduler(self.ckpt.config("scheduler"), dict(spec.scheduler))
        self.configs = {name: c.parse_config(self.raw[c.folder]) for name, c in family.components().items()}
        has_tokenizer = self.ckpt.tokenizer_dir.is_dir()
        self.tokenizer = load_tokenizer(self.ckpt.tokenizer_dir) if has_tokenizer or not configs_only else None
        self.loras = ()    # checked by validate()


def validate(spec: BuildSpec, ctx: Context) -> None:
    """Every error a build can know of before it writes anything."""
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
    for name in spec.components:
        expected_tensors(family.component(name), ctx.configs[name], tp_of(name, spec.tp))  # raises naming head counts
    if spec.loras:
        target = lora_target()
        if target.name not in spec.components:
            raise ConfigError(f"LoRAs are merged into the {target.name}, which this build leaves out",
                              f"add {target.name} to --components, or drop --lora")
        weights = ctx.ckpt.weights(target.folder).tensors
        ctx.loras = tuple(load_lora(path, scale, weights) for path, scale in spec.loras)


def looped(spec: BuildSpec, component: str) -> bool:
    """Whether the component's graphs loop one block over stacked weights."""
    return spec.layers_of(component) == "looped" and family.component(component).stackable


def tp_of(component: str, tp: int) -> int:
    """Replicated components (no plan entries, e.g. the VAE decoder) are sharded and compiled once."""
    return family.component(component).tp_degree(tp)


def lora_target() -> family.Component:
    """The component LoRAs merge into (its definition's lora_target)."""
    return next(c for c in family.components().values() if c.lora_target)
