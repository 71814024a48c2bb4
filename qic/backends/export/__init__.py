"""The export back end: each graph's torch.export program, saved as it is and run by torch at load, with no
compiler. A bundle in seconds where the inductor back end takes minutes, to check a new checkpoint, a layout, a
prompt set or a host program before the long compile; everything around the graphs (keys, the compile cache,
shards, manifests, layouts, the host programs) is the same as for the compiled back ends.

    build.py    the build half (trace = the inductor back end's torch.export, compile = torch.export.save)
    load.py     the run half (torch.export.load, run under inference mode)

This file stays light (no torch): the registry reads the devices here.
"""

NAME = "export"
DEVICES = ("cpu",)   # CUDA: not yet (never run; the inductor back end builds for it)
DEFAULT_DEVICE = "cpu"
RUN_DEVICES = DEVICES
# Its graphs may take a dynamic text length: a build without text buckets then gets exact-length text (qic.spec).
DYNAMIC_TEXT = True
# Its loaded graphs run over other weights per call (the load's `rebind`): LoRA slots filled per request (qic.spec).
REBINDS_WEIGHTS = True
OPTIONS: dict = {}   # build-config keys only this back end takes (see the inductor package)
# What `qic plan` assumes a graph takes without records in the cache (qic.builder.memplan; inductor's is its
# default): export and save measured 0.7-1.1 s per tiny graph on two cores.
PLAN_COMPILE_SECONDS = 1.0
