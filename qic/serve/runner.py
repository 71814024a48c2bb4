"""The server's view of a loaded bundle: what it serves, how a request is checked, and running it.

Images come from the runtime's own `generate` and `png_bytes`, so a served PNG is byte for byte the
file `qic run` writes with the same settings.
"""

from __future__ import annotations

from qic.runtime.bundle import Bundle
from qic.runtime.generate import Request, generate, text_plan, validate
from qic.runtime.png import png_bytes

# The generation loop runs one image at a time; batched denoise graphs would be listed in the
# manifest's `batch_sizes` by a build that makes them, and the runner would then run them.
RUNTIME_BATCH_SIZES = (1,)


def manifest_batch_sizes(manifest: dict) -> tuple[int, ...]:
    """The batch sizes a bundle has graphs for (`batch_sizes` in the manifest; bundles without it: 1)."""
    sizes = manifest.get("batch_sizes", [1])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 1 for s in sizes):
        return (1,)
    return tuple(sorted({1, *sizes}))


class BundleRunner:
    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        # The served model is named after the bundle directory (what the operator chose to deploy).
        self.model_id = bundle.path.resolve().name
        self.created = int(bundle.path.joinpath("manifest.json").stat().st_mtime)
        self.bundle_batch_sizes = manifest_batch_sizes(bundle.manifest)
        self.batch_sizes = tuple(s for s in self.bundle_batch_sizes if s in RUNTIME_BATCH_SIZES)
        # OpenAI sizes are WIDTHxHEIGHT; the bundle lists (height, width).
        self.sizes = {f"{w}x{h}": (h, w) for h, w in bundle.resolutions}

    def plan(self, req: Request) -> tuple:
        """Check a request against the bundle (ConfigError if it cannot run) and return its batch key:
        requests with equal keys run the same graphs with the same scalars' shapes."""
        validate(req, self.bundle)
        text = text_plan(self.bundle, req)
        return (req.height, req.width, text.bucket, req.steps, text.cfg)

    def run(self, reqs: list[Request]) -> list[bytes]:
        if len(reqs) not in self.batch_sizes:
            raise RuntimeError(f"batch of {len(reqs)}: this runner runs {self.batch_sizes}")
        return [png_bytes(generate(self.bundle, r), self.bundle.id) for r in reqs]
