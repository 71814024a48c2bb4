"""Tensor parallelism (Megatron-style) for qic's components.

`qic.parallel.plans` says which tensors split along which dim; `qic.builder.shard` writes each rank's part.
`qic.parallel.tp` turns a module built with tp_size=N into one rank's part of the computation: every
row-parallel projection (`RowLinear`) sums its partial products with a functional all_reduce over the
process group, inside the graph, so an exported/compiled graph carries its own collectives and the
runtime stays a loop of graph calls. It also holds the process-group helpers (torchrun and a local
spawner on loopback with gloo).
"""
