"""The dtypes a build may ask for, by the names configs and manifests use."""

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
