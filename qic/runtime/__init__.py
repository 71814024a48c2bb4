"""The minimal runtime: load a bundle and execute it.

Imports only the manifest, the back ends' loaders, host glue, tokenizers, torch, safetensors and PIL:
never model definitions (qic.models) or compiler code (qic.builder, torch._inductor). A test enforces it.
"""
