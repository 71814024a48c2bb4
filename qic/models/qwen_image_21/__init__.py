"""Qwen-Image-2.1 (diffusers' QwenImage21Pipeline): eager modules and host arithmetic of the second family."""
