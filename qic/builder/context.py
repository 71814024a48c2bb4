"""What a build knows before it does any work: the checkpoint, its configs, the tokenizer, the LoRAs, and every
error that can be found by looking (validate). Shared by `qic build` and `qic warm`."""

from __future__ import annotations

from pathlib import Path

from qic import family
from qic.builder.components import expected_tensors
from qic.builder.source import check_family, resolve_model
from qic.checkpoint.lora import load_lora
from qic.errors import ConfigError
from qic.host.schedule import merge_scheduler
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
        # The family the checkpoint's model_index.json picks: its components are what the stages look up.
        self.family = family.use(check_family(spec, self.ckpt))
        self.raw = {f: self.ckpt.config(f) for f in family.folders()}
        # A family without a scheduler (or a tokenizer) has none in its checkpoint; its own checks say when it
        # needs one (Qwen-Image's validate: qic/models/qwen_image/components.py).
        has_scheduler = (self.ckpt.root / "scheduler").is_dir()
        self.scheduler = merge_scheduler(self.ckpt.config("scheduler"), dict(spec.scheduler)) if has_scheduler else None
        self.configs = {name: c.parse_config(self.raw[c.folder]) for name, c in family.components().items()}
        has_tokenizer = self.ckpt.tokenizer_dir.is_dir()
        self.tokenizer = load_tokenizer(self.ckpt.tokenizer_dir) if has_tokenizer else None
        self.loras = ()    # checked by validate()


def validate(spec: BuildSpec, ctx: Context) -> None:
    """Every error a build can know of before it writes anything."""
    hook = getattr(family.components_module(), "validate", None)
    if hook is not None:   # the family's own checks (its resolutions, buckets, scheduler, tokenizer, layouts)
        hook(spec, ctx)
    for name in spec.components:
        expected_tensors(family.component(name), ctx.configs[name], tp_of(name, spec.tp))  # raises naming head counts
    if spec.loras:
        target = lora_target()
        if target.name not in spec.components:
            raise ConfigError(f"LoRAs are merged into the {target.name}, which this build leaves out",
                              f"add {target.name} to --components, or drop --lora")
        weights = ctx.ckpt.weights(target.folder).tensors
        ctx.loras = tuple(load_lora(path, scale, weights) for path, scale in spec.loras)
    if spec.lora_slots:
        lora_target()   # a family that takes no LoRAs: one line


def looped(spec: BuildSpec, component: str) -> bool:
    """Whether the component's graphs loop one block over stacked weights."""
    return spec.layers_of(component) == "looped" and family.component(component).stackable


def tp_of(component: str, tp: int) -> int:
    """Replicated components (no plan entries, e.g. the VAE decoder) are sharded and compiled once."""
    return family.component(component).tp_degree(tp)


def lora_target() -> family.Component:
    """The component LoRAs merge into (its definition's lora_target)."""
    found = next((c for c in family.components().values() if c.lora_target), None)
    if found is None:
        raise ConfigError(f"the {family.current().name} family takes no LoRAs", "drop --lora")
    return found
