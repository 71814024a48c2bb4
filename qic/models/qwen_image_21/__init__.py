"""The Qwen-Image-2.1 family (diffusers' QwenImage21Pipeline), text to image through qic build / qic run.

- `family.py`: the record (class QwenImage21Pipeline, tokenizer in the checkpoint's processor/ folder);
- `components.py`: text_encoder per text bucket, denoiser as prefill + decode per resolution and bucket,
  vae_decoder per resolution, and what is not wired yet refused in one line (validate);
- `graphs.py`: the graph makers and their inputs (the runtime's contract);
- eager modules: `denoiser.py` (block-causal single-stream DiT, prefill and cached decode) and `looped.py`,
  `text_encoder.py` (Qwen3-VL language-model prefill), `vision.py` (Qwen3-VL vision tower, not yet a graph),
  `vae.py` (encoder, not yet a graph, and decoder);
- `host/`: the host program (`host/__init__.py`) and its host-only arithmetic: `sampling.py` (schedule, sizes,
  noise, packing), `sequence.py` (the per-request prefix tensors), `prompt.py` (the pipeline's prompt text).
  The runtime imports only this package of the folder (qic.runtime.programs); the model modules import from it.
"""
