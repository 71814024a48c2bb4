"""The Qwen-Image-2.1 family (diffusers' QwenImage21Pipeline): build-time eager modules, pure torch.

This folder will hold the whole family once the family seam (issue 30) lands: its eager modules (the
block-causal single-stream denoiser in `denoiser.py`, with the per-request sequence tensors of `sequence.py`;
the 2.1 VAE encoder and decoder in `vae.py`, later the Qwen3-VL language model and vision tower), the host
arithmetic of `sampling.py` (schedule, sizes, packing), its component list
with their graphs and buckets, its TP plan table, its checkpoint reader and tensor-name map, and its host
program (the per-request sequence of graph calls: a prefill of the [text | conditions | target] sequence
on the first step, then decodes of the target tokens against the resident prefix K/V).

Nothing here is wired into the builder or the runtime yet; qic.runtime never imports this package.
"""
