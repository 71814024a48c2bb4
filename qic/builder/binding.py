"""Binding a component's eager module to weights: a rank's memory-mapped shard (qic build), or stand-ins of
the shard's shapes when there are no weights (qic warm compiles from configs alone), with TP applied."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from qic import family
from qic.builder.compile import compile_graph
from qic.builder.components import expected_tensors
from qic.builder.context import Context, looped, tp_of
from qic.builder.lora_slots import with_slots
from qic.dtypes import TORCH_DTYPES
from qic.errors import ConfigError
from qic.weights import mmap_safetensors


def shard_shapes(ctx: Context, component: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one rank's weight shard: exactly the module's state dict (loaded strictly)."""
    return expected_tensors(family.component(component), ctx.configs[component], tp_of(component, ctx.spec.tp),
                            looped=looped(ctx.spec, component))


def weight_names(ctx: Context, component: str, weights_path: Path | None) -> set[str]:
    """The tensors the component's shard holds (its file's header, or the shapes it would have)."""
    if weights_path is None:
        return set(shard_shapes(ctx, component))
    from qic.checkpoint.safetensors_file import read_header
    return set(read_header(weights_path).tensors)


def bound_module(ctx: Context, component: str, weights_path: Path | None) -> torch.nn.Module:
    """The eager module with memory-mapped shard tensors assigned (no copy, nothing touched), or with
    uninitialised stand-ins of the shard's shapes and dtype when there are no weights (torch.empty
    only reserves address space until written, and compiling never reads weight values)."""
    comp = family.component(component)
    tp = tp_of(component, ctx.spec.tp)
    dtype = TORCH_DTYPES[comp.run_dtype(ctx.spec.dtype_of(component))]
    with torch.device("meta"):
        module = comp.make_module(ctx.configs[component], tp_size=tp, looped=looped(ctx.spec, component))
    if weights_path is not None:
        tensors = mmap_safetensors(weights_path)
    else:  # shards hold every float tensor in the component's dtype (stage 1), integer ones (a rank's
        # vocab_start) in their own: an index must stay an integer for the graph to trace
        own = module.state_dict()
        tensors = {n: torch.empty(shape, dtype=dtype if own[n].is_floating_point() else own[n].dtype)
                   for n, shape in shard_shapes(ctx, component).items()}
    module.load_state_dict(tensors, strict=True, assign=True)
    module = module.to(dtype)
    layout = ctx.spec.layout
    if tp > 1 or not layout.plain:
        # The collectives enter the graph by their groups' names: the world group's ("0") for plain TP, the
        # mesh axes' aliases otherwise (qic/parallel/mesh.py); at run time each rank's groups have those
        # names. Tracing needs groups of the right sizes: fake ones, no peers. The step's own hooks (Ulysses,
        # CFG-parallel) are set where the graph wraps the module (qic.builder.graphs).
        from qic.parallel.tp import apply_tp
        fake_world(layout)
        if tp > 1:
            apply_tp(module, layout.group_name("tp"))
    return module


def fake_world(layout) -> None:
    import torch.distributed as dist

    from qic.parallel.mesh import fake_join
    world = layout.world
    if dist.is_initialized():
        if dist.get_backend() == "fake" and _FAKE.get("layout") != layout:
            dist.destroy_process_group()  # our own tracing group for another layout (a warm matrix)
        elif dist.get_backend() != "fake" and dist.get_world_size() != world:
            raise ConfigError(f"a process group of {dist.get_world_size()} ranks is active; building for "
                              f"{layout.describe()} needs none (build from a plain process)")
        else:
            return   # our fake world for this layout, or a real one of its size (the mesh joined by the caller)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if not layout.plain:
        fake_join(layout)
    _FAKE["layout"] = layout


_FAKE: dict = {}   # the layout our fake tracing world was made for


@contextlib.contextmanager
def fake_world_for(layout):
    """fake_world for the block's duration only: a world this made is destroyed after it, so that estimating a
    plan in a process (qic plan through the CLI runner, tests) leaves no process group behind."""
    import torch.distributed as dist
    made = not dist.is_initialized()
    fake_world(layout)
    try:
        yield
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()
            _FAKE.clear()


def compile_job(job, ctx: Context, backend, weights_path: Path | None = None, remote=None, sign=None, workers=None):
    """Compile (or find) one job's graph, its weights bound from a shard file, or stood in by shapes
    when `weights_path` is None (graphs take weights as inputs, so their values never matter); `workers`:
    compile_graph's."""
    names = weight_names(ctx, job.component, weights_path)
    art = compile_graph(lambda: job.maker(with_slots(bound_module(ctx, job.component, weights_path), job.component,
                                                     job.shape)),
                        backend, names, ctx.cache, job.spec_key, remote=remote, sign=sign, workers=workers)
    # Named as this job: two graph names can share one entry when their graphs are identical (a one-row
    # middle graph is the same at every batch size), and the entry remembers only the first name it had.
    return dataclasses.replace(art, meta={**art.meta, "graph": job.name})
