"""Reading diffusers-layout checkpoints, resolving model sources, and the embedded tiny checkpoints."""
