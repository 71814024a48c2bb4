"""Qwen-Image (diffusers' QwenImagePipeline): the family's folder. Its eager modules (mmdit, text_encoder,
vae_decoder, step, step_cache, ulysses), its graph makers (graphs), its component definitions with their TP
tables (components), its checkpoint tensor-name map (tensor_names).

Importing the package imports nothing: build-time code imports the modules it needs.
"""
