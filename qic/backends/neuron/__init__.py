"""The neuron back end (AWS Trainium): graphs lowered to HLO with torch-xla, checked on XLA:CPU, compiled to
NEFFs by neuronx-cc where it is installed, run through libnrt. docs/neuron.md says what has run where.

    build.py        the build half (trace = lower to HLO, compile = write + check on XLA:CPU, finish = NEFFs)
    lower.py        the lowering itself; hlo_proto.py edits the serialized module's parameters
    cc.py           neuronx-cc's command line, its cache keys and parallel compiles
    load.py         the run half: a NEFF through libnrt (nrt.py) or the HLO on XLA:CPU (xla_runtime.py)

This file stays light (no torch): the registry reads the devices here.
"""

NAME = "neuron"
DEVICES = ("neuron",)
DEFAULT_DEVICE = "neuron"
RUN_DEVICES = ("neuron", "xla-cpu")
OPTIONS: dict = {}   # build-config keys only this back end takes (see the inductor package)

# A graph's files, in its cache entry and bundle folder (written by build.py, read by load.py).
HLO_FILE = "model.hlo_module.pb"   # the HLO module (entry parameters = used graph inputs, then weights)
PARAMS_FILE = "params.json"        # which graph input or weight feeds each HLO parameter
NEFF_FILE = "model.neff"           # the compiled graph (absent in a lower-only bundle)
