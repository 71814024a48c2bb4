"""Training the embedded shapes model (issue 20): its data and meaning check (shapes.py). Kept out of the
wheel, like benchmarks/: the runtime and the builder never import it."""
