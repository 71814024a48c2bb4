"""Build-time eager model definitions. Pure torch, compile-friendly; never imported by qic.runtime."""
