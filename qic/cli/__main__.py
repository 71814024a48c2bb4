"""`python -m qic.cli`: what torchrun launches (each process one rank)."""

from qic.cli import main

main()
