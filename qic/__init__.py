"""qic: the Qwen-Image compiler."""

__version__ = "0.1.0"
