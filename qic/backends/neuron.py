"""AWS Neuron back end (torch-neuronx / neuronx-distributed, NEFFs on Trainium).

Not implemented in this version of qic: the SDK cannot be installed on the machines qic is developed
on. Selecting it fails with this message rather than pretending; the interface in qic.backends.base
is what the implementation will fill in (see the tensor-parallel and depth-independent issues).
"""

from __future__ import annotations

from qic.backends.base import Backend
from qic.errors import ConfigError


class NeuronBackend(Backend):
    name = "neuron"

    def __init__(self, device: str):
        try:
            import torch_neuronx  # noqa: F401
        except ImportError:
            raise ConfigError("the neuron back end needs the AWS Neuron SDK (torch-neuronx), which is not installed",
                              "build on a Trainium host with the Neuron SDK, or use --backend inductor") from None
        raise ConfigError("the neuron back end is not implemented in this qic version",
                          "use --backend inductor")

    def identity(self) -> dict:  # pragma: no cover - unreachable until implemented
        raise NotImplementedError

    def compile(self, module, example_inputs, out_dir, dynamic_shapes=None):  # pragma: no cover
        raise NotImplementedError
