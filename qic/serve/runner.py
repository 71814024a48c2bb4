"""The server's view of a loaded bundle: what it serves, how a request is checked, and running it.

Images come from the bundle's own host program (qic.runtime.programs: the family's, as `qic run` runs it) and
`png_bytes`: a batch of one is exactly `qic run`'s `generate`, and a batch of n (text to image, through the
bundle's `@B<n>` graphs) gives each request the image it would get alone (see tests/test_batching.py for the
bound). With tensor parallelism, rank 0 serves HTTP and sends each batch to the other ranks over a control process
group before running it; every rank then runs the same batch, whose graphs all-reduce among them.
"""

from __future__ import annotations

import datetime
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from qic.errors import ConfigError
from qic.runtime.bundle import Bundle
from qic.runtime.png import png_bytes
from qic.runtime.programs import makes_previews, program_of, run_batch
from qic.serve.metrics import StageClock
from qic.serve.queue import Unavailable


def manifest_batch_sizes(manifest: dict) -> tuple[int, ...]:
    """The batch sizes a bundle has graphs for (`batch_sizes` in the manifest; bundles without it: 1)."""
    sizes = manifest.get("batch_sizes", [1])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 1 for s in sizes):
        return (1,)
    return tuple(sorted({1, *sizes}))


# Ranks wait on the control group between requests, which may be idle for days; the compute
# collectives inside the graphs keep the short timeout that makes a dead rank an error within seconds.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


def warm(bundle: Bundle) -> None:
    """Run every graph once on placeholder inputs before the server says it is ready (rank 0 runs it on its
    compute thread once the port is open, ahead of any request's batch), so that no request pays for first touches
    (memory-mapped weight pages, kernel and allocator set-up). The outputs are dropped. At tp>1 every rank calls
    it, in manifest order, so the graphs' all-reduces pair up."""
    for graph in bundle.graphs.values():
        # Token ids and masks of ones (a real token, attended), zeros elsewhere: finite everywhere.
        graph(*(torch.ones(spec["shape"], dtype=torch.long) if spec["dtype"] == "int64" else
                torch.zeros(spec["shape"]) for spec in graph.inputs))


def load(path, rank: int, world: int, compute: ThreadPoolExecutor | None, **load) -> tuple[Bundle, float]:
    """The bundle loaded (verified first) on `compute` (None: on this thread), and the seconds it took. `load`:
    Bundle's device, weights_from and verify_all, as `qic run` passes them."""
    t = time.perf_counter()
    bundle = compute.submit(Bundle, path, rank=rank, world=world, **load).result() if compute else \
        Bundle(path, rank=rank, world=world, **load)
    return bundle, time.perf_counter() - t


def serve_adapters(bundle: Bundle, named: dict | None, budget: float | None) -> None:
    """The adapters requests may name (`--lora NAME=FILE`, checked against the bundle's slots before the port opens):
    on a slotted bundle always set, so that a request names only these, never a file of the server's; adapters
    without slots are one line."""
    from qic.runtime.lora import Adapters
    if bundle.lora_slots:
        bundle.adapters = Adapters(bundle, named, budget)
    elif named:
        raise ConfigError(f"--lora: {bundle.path} takes no adapters per request (built without --lora-slots)",
                          "rebuild it with --lora-slots R, or merge the LoRA at build time (qic build --lora)")


def weight_sets(bundle: Bundle, rank: int, world: int, load: dict, named: dict, budget: float | None,
                compute: ThreadPoolExecutor | None = None):
    """The named weight sets served beside the bundle's own (qic.serve.weight_sets.WeightSets; None without any),
    each loaded once now, in order, on `compute` (None: this thread): a set that does not fit the graphs is one line
    before the port opens, and every rank loads the same sets in the same order. `load`: the load options of the
    bundle (device, verify_all; each set is its own weights_from)."""
    if not named:
        return None
    from qic.serve.weight_sets import WeightSets
    options = {k: v for k, v in load.items() if k != "weights_from"}

    def load_set(path):
        loaded = Bundle(bundle.path, rank=rank, world=world, weights_from=path, code_from=bundle, **options)
        if getattr(bundle, "adapters", None) is not None:   # one set of graphs: the same slots and adapters
            loaded.adapters = bundle.adapters
        return loaded
    sets = WeightSets(bundle, bundle.path.resolve().name, named, load_set, budget)
    compute.submit(sets.check_all).result() if compute else sets.check_all()
    # Mapped again later, a set is checked by its hash records (files changed since are re-hashed), not re-hashed
    # whole: --verify-all is the start's.
    options["verify_all"] = False
    return sets


def control_group(world: int):
    """A gloo group for passing batches from rank 0 (None at tp=1). Every rank calls it, in order."""
    if world == 1:
        return None
    from qic.parallel.ranks import new_group
    return new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def follow(bundle: Bundle, group, sets=None) -> None:
    """A rank above 0: run each batch rank 0 sends (its requests and the model whose weights run them: this rank's
    WeightSets `sets` maps the named ones as rank 0's does), until it sends None (its server has stopped)."""
    import torch.distributed as dist
    program = program_of(bundle.manifest)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return
        reqs, model = box[0]
        run_batch(program, bundle if model is None else sets.get(model), reqs)


class BundleRunner:
    def __init__(self, bundle: Bundle, group=None, executor: ThreadPoolExecutor | None = None, sets=None):
        """sets: qic.serve.weight_sets.WeightSets, the named weight sets served beside the bundle's own (None:
        only its own)."""
        self.bundle = bundle
        self.sets = sets
        self.program = program_of(bundle.manifest)   # the family's host program, as qic run runs it
        self.group = group   # the control group when tensor-parallel
        self.executor = executor   # the thread the bundle was loaded and warmed on; run() is called there
        # The served model is named after the bundle directory (what the operator chose to deploy).
        self.model_id = bundle.path.resolve().name
        self.created = int(bundle.path.joinpath("manifest.json").stat().st_mtime)
        self.batch_sizes = manifest_batch_sizes(bundle.manifest)   # all run: the program's batches take any
        # OpenAI sizes are WIDTHxHEIGHT; the bundle lists (height, width).
        self.sizes = {f"{w}x{h}": (h, w) for h, w in bundle.resolutions}
        self.stage_clock = StageClock(bundle)   # seconds per component's graphs, for /metrics
        self.models = sets.names if sets is not None else [self.model_id]   # the first: the bundle's own
        # Why this bundle streams no partial images (None: it does). Rank 0 alone decodes them (the decoder graph
        # has no collectives), which ranks run in lockstep cannot allow.
        self.no_partials = None
        if not makes_previews(self.program):
            self.no_partials = f"its host program ({self.program.__name__}) makes no previews"
        elif bundle.lockstep and bundle.layout.world > 1:
            self.no_partials = (f"its ranks run in lockstep on {bundle.device} (every rank must call the same "
                                "graphs), and only rank 0 would decode them")

    def plan(self, req) -> tuple:
        """Check a request against the bundle (ConfigError if it cannot run) and return its batch key:
        requests with equal keys run the same graphs with the same scalars' shapes."""
        return self.program.plan(self.bundle, req)

    def run(self, reqs: list, previews=None, model: str | None = None) -> list[bytes]:
        """PNG bytes per request. previews: qic.runtime.loop's, on this rank only (streamed partial images). model:
        the weight set that runs them (None: the bundle's own)."""
        if len(reqs) not in self.batch_sizes:
            raise RuntimeError(f"batch of {len(reqs)}: this runner runs {self.batch_sizes}")
        model = None if model == self.model_id else model
        bundle = self._bundle(model)   # mapped before the ranks are told: a set that fails to map fails this batch
        if self.group is None:
            return self._run(bundle, reqs, previews)
        import torch.distributed as dist
        try:
            dist.broadcast_object_list([(reqs, model)], src=0, group=self.group)
            return self._run(bundle, reqs, previews)
        except Exception as e:
            # Every rank ran this batch: whatever failed here failed on the others too, or a collective
            # broke (a rank died). Either way the ranks are out of step for good.
            raise Unavailable(f"a tensor-parallel batch failed ({type(e).__name__}: {e})") from e

    def _bundle(self, model: str | None) -> Bundle:
        if model is None:
            return self.bundle
        bundle = self.sets.get(model)
        self.stage_clock.watch(bundle)
        return bundle

    def _run(self, bundle: Bundle, reqs: list, previews=None) -> list[bytes]:
        return [png_bytes(r, bundle.id, bundle.weights_id) for r in run_batch(self.program, bundle, reqs, previews)]

    def close(self) -> None:
        """Release the other ranks (tensor-parallel): nothing more will come."""
        if self.group is not None:
            import torch.distributed as dist
            dist.broadcast_object_list([None], src=0, group=self.group)
