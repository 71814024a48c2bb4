"""Where a build's checkpoint comes from: an embedded model (the trained default or a random preset), a local
directory, or a hub id."""

from __future__ import annotations

import os
from pathlib import Path

from qic import family
from qic.cache import layout
from qic.checkpoint.model_index import EMBEDDED_PREFIX, is_hub_id, local_model_index  # noqa: F401 (re-exported)
from qic.checkpoint.reader import Checkpoint
from qic.errors import CheckpointError


def resolve_model(model: str | None, cache_dir: Path, configs_only: bool = False) -> Checkpoint:
    """None -> the default embedded checkpoint (the trained `shapes`, written once into the cache); an
    embedded preset; a directory; or a hub id (configs_only: only its configs and tokenizer are fetched)."""
    if model is None or model.startswith(EMBEDDED_PREFIX):
        from qic.checkpoint.embedded import write_checkpoint

        preset = embedded_preset(model)
        root = write_checkpoint(layout.embedded_dir(cache_dir, preset), preset_name=preset, seed=0)
        return Checkpoint(root, model_id=f"{EMBEDDED_PREFIX}{preset}")
    if not is_hub_id(model):
        path = Path(model).expanduser()
        return Checkpoint(path, model_id=str(path.resolve()))
    return Checkpoint(_from_hub(model, hub_patterns(model, configs_only)), model_id=model)


def hub_patterns(repo_id: str, configs_only: bool = False) -> list[str]:
    """The files a build needs from a hub repo, by its family (read from its model_index.json, fetched first):
    the scheduler, the family's tokenizer folder (Qwen-Image's tokenizer/, 2.1's processor/) and each component's
    folder (configs_only, what `qic warm` compiles from: their config.json files, not the weights), and the
    processor/ folder where a repo has one (the Edit models' image-processor settings). Qwen-Image's vision tower
    lives in the text encoder's shards (read by an edit build only)."""
    index = local_model_index(repo_id) or _from_hub(repo_id, ["model_index.json"]) / "model_index.json"
    fam = family.of_model_index(index)
    folders = dict.fromkeys(family.folders(fam))
    parts = [f"{f}/config.json" for f in folders] if configs_only else [f"{f}/*" for f in folders]
    return list(dict.fromkeys(["model_index.json", "scheduler/*", f"{fam.tokenizer}/*", "processor/*", *parts]))


def fetch_model_indexes(models) -> bool:
    """Fetch the model_index.json of each hub id not in the local hub cache yet; True when one was fetched. A spec
    is parsed without a download, so the family of a repo fetched for the first time is the default's guess
    (qic.spec.model_family): `qic build`, `plan` and `warm` call this first and parse their specs again when it
    fetched, so that one command builds a repo of any family."""
    fetched = False
    for model in dict.fromkeys(models):
        if isinstance(model, str) and is_hub_id(model) and local_model_index(model) is None:
            _from_hub(model, ["model_index.json"])
            fetched = True
    return fetched


def load_spec_by_family(config, overrides):
    """qic.spec.load_spec, parsed again when its model is a hub repo whose model_index.json had to be fetched first
    (fetch_model_indexes): `qic build` and `qic plan`'s spec, of the family the repo names."""
    from qic.spec import load_spec
    spec = load_spec(config, overrides)
    return load_spec(config, overrides) if fetch_model_indexes([spec.model]) else spec


def embedded_preset(model: str | None) -> str:
    """The embedded preset a model names (None: the default)."""
    from qic.checkpoint.presets import DEFAULT
    return model[len(EMBEDDED_PREFIX):] if model else DEFAULT


def display_name(model: str | None) -> str:
    return model or f"{EMBEDDED_PREFIX}{embedded_preset(None)}"


def _from_hub(repo_id: str, patterns: list[str]) -> Path:
    """Resolve through huggingface-hub; HF_HUB_OFFLINE=1 uses only the local hub cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{repo_id}: not in the local hub cache and HF_HUB_OFFLINE is set" if offline else
                              f"{repo_id}: could not be downloaded and is not in the local hub cache",
                              f"download it first (hf download {repo_id}) or pass a local directory") from None
    except Exception as e:  # network errors, missing repos, auth: one line naming the id
        raise CheckpointError(f"{repo_id}: hub resolution failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                              "check the id, your network, or pass a local directory") from None


def check_family(spec, ckpt: Checkpoint) -> family.Family:
    """The family of the resolved checkpoint (its model_index.json), which must be the one the spec was checked
    for: they differ only where the spec was read before the checkpoint was fetched (qic.spec.model_family)."""
    fam = family.of_model_index(ckpt.root / "model_index.json")
    if fam.name != spec.family:
        raise CheckpointError(f"{display_name(spec.model)}: its model_index.json is of the {fam.name} family, but "
                              f"the build config was checked as {spec.family}'s before the checkpoint was fetched",
                              "run the command again: the checkpoint is now fetched and its family known")
    return fam


def resolve_configs(model: str | None, cache_dir: Path) -> tuple[dict, dict]:
    """(parsed config per component, raw config per checkpoint folder) of the family being built (qic.family.use),
    reading configs only: an embedded preset, a local directory (weights not needed), or a hub id (only its
    config files are fetched)."""
    from qic.checkpoint.presets import PRESETS, preset

    if model is None or model.startswith(EMBEDDED_PREFIX):
        name = embedded_preset(model)
        try:
            raw = {f: preset(name)[f] for f in family.folders()}
        except KeyError as e:
            raise CheckpointError(str(e.args[0]), "use " + ", ".join(EMBEDDED_PREFIX + n for n in PRESETS)) from None
    else:
        patterns = ["model_index.json", "scheduler/*.json", *(f"{f}/config.json" for f in family.folders())]
        path = _from_hub(model, patterns) if is_hub_id(model) else Path(model).expanduser()
        ckpt = Checkpoint(path)
        raw = {f: ckpt.config(f) for f in family.folders()}
    return {n: c.parse_config(raw[c.folder]) for n, c in family.components().items()}, raw
