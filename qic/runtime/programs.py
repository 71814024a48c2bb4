"""The host programs: which one runs a bundle, by the name its manifest records (its family's `host`).

A host program is host code over a loaded model's graphs (qic.runtime.protocol.Runnable): tokenise, schedule, call
graphs by name, decode, and nothing that is a model (no nn.Module, no model definitions). It is a module with
`Request` (one image's run options, a dataclass) and `generate(model, request) -> Result` (`image`, a PIL image;
`timings`, seconds by stage in the order they ran). For `qic serve` it also has `plan(model, request) -> key` (the
request checked and its defaults filled in before it queues; requests with equal keys may share a batch) and may
have `generate_batch(model, requests) -> [Result]` (without it, every batch is one request). The registry is where a
family may put one: a module of qic.runtime (the text-to-image program, qic/runtime/generate.py, which a family
whose graphs have the roles text_encoder, denoiser and vae_decoder names), or the `host` module of a known family's
own folder (qic.family.packages, found without importing any family's code). Nothing else is imported, whatever a
manifest names.
"""

from __future__ import annotations

import importlib

from qic import family
from qic.errors import BundleError

RUNTIME = "qic.runtime."   # programs the runtime ships


def known(host: str) -> bool:
    """Whether `host` is a host program qic may run: a runtime program, or a known family folder's host module."""
    return host.startswith(RUNTIME) or host in {f"{p}.host" for p in family.packages()}


def program_of(manifest: dict):
    """The host program module of a bundle; one qic does not know (its family's package not installed) is one
    BundleError line."""
    record = manifest.get("family") or {}
    host = record.get("host")
    if not isinstance(host, str) or not known(host):
        raise BundleError(f"bundle of model family {record.get('name')!r} runs host program {host!r}, which this "
                          "qic does not know", "install the package that provides the family, or rebuild the bundle")
    return importlib.import_module(host)


def serving(program) -> bool:
    """Whether qic serve can admit a program's requests (it has `plan`)."""
    return callable(getattr(program, "plan", None))


def makes_previews(program) -> bool:
    """Whether a program's runs can hand out previews (qic.runtime.loop's; qic serve's partial images): its
    generate (and generate_batch) take them."""
    import inspect
    return all("previews" in inspect.signature(f).parameters
               for f in (program.generate, getattr(program, "generate_batch", program.generate)))


def run_batch(program, model, requests: list, previews=None) -> list:
    """A batch through the program: its generate_batch, else its generate (a batch of one). previews:
    qic.runtime.loop's, given only to a program that takes them (makes_previews)."""
    hooks = {} if previews is None else {"previews": previews}
    batch = getattr(program, "generate_batch", None)
    if batch is not None:
        return batch(model, requests, **hooks)
    if len(requests) != 1:
        raise RuntimeError(f"batch of {len(requests)}: {program.__name__} runs one request at a time")
    return [program.generate(model, requests[0], **hooks)]
