"""Where a model's model_index.json is on this machine, without a download or the builder: the spec reads it to
pick the model's family (qic.spec.model_family) before anything is built."""

from __future__ import annotations

import re
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"   # embedded:shapes (the default, trained), embedded:tiny, embedded:tiny-alt, ...
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    """ORG/NAME that is not an existing path nor written as one (./x, /x, ~/x): a hub repository id."""
    return not (Path(model).expanduser().exists() or model.startswith((".", "/", "~"))) and bool(_HUB_ID.match(model))


def local_model_index(model: str | None) -> Path | None:
    """The model_index.json of a model where it is on this machine without a download: a local directory's, or
    a hub id's in the local hub cache; None for an embedded model (its class: qic.checkpoint.presets), or where
    there is none to read yet."""
    if model is None or model.startswith(EMBEDDED_PREFIX):
        return None
    if not is_hub_id(model):
        index = Path(model).expanduser() / "model_index.json"
        return index if index.is_file() else None
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(model, "model_index.json")
    return Path(found) if isinstance(found, str) else None
