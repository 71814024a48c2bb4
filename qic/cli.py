"""The `qic` command: thin click commands, each calling one function, imported lazily.

Errors users can fix print as one line plus the fix, never a traceback.
"""

from __future__ import annotations

import sys
from functools import wraps

import click


def _friendly(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        from qic.errors import QicError
        try:
            return fn(*args, **kwargs)
        except QicError as e:
            click.echo(f"error: {e.message}", err=True)
            if e.hint:
                click.echo(f"  fix: {e.hint}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
    return wrapper


@click.group()
@click.version_option(package_name="qic")
def main():
    """qic: compile Qwen-Image checkpoints into ready-to-run bundles, and run them."""


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--model", help="Checkpoint: a local diffusers-layout directory or a hub id (default: embedded tiny).")
@click.option("--backend", help="inductor | neuron")
@click.option("--device", help="cpu | cuda (inductor), neuron")
@click.option("--tp", type=int, help="Tensor-parallel degree.")
@click.option("--resolution", "resolutions", multiple=True, help="HxW, repeatable; replaces the config's list.")
@click.option("--text-buckets", help="Comma-separated lengths, a step (e.g. 64), or 0 for exact length.")
@click.option("--components", help="Comma-separated subset of text_encoder,denoiser,vae_decoder.")
@click.option("--layers", type=click.Choice(["unrolled", "looped"]),
              help="Transformer blocks unrolled in the graph, or one block looped over stacked weights.")
@click.option("--output", help="Bundle directory to write.")
@click.option("--cache-dir", help="Shard and compile cache directory.")
@_friendly
def build(config, model, backend, device, tp, resolutions, text_buckets, components, layers, output, cache_dir):
    """Shard, compile and bundle a checkpoint (CONFIG: a YAML build config; default configs/tiny.yaml)."""
    from qic.cli_build import run_build
    overrides = {"model": model, "backend": backend, "device": device, "tp": tp,
                 "resolutions": list(resolutions) or None, "text_buckets": text_buckets,
                 "components": components, "layers": layers, "output": output,
                 "cache_dir": cache_dir}
    run_build(config, overrides)


@main.command()
@click.argument("bundle", type=click.Path())
@click.option("--verify", is_flag=True,
              help="Re-hash every weight file, not only those changed since they were last verified.")
@_friendly
def inspect(bundle, verify):
    """Print a bundle's manifest and check every file's hash."""
    from qic.cli_inspect import run_inspect
    run_inspect(bundle, full=verify)


@main.command()
@click.argument("bundle", type=click.Path())
@click.option("--prompt", help="What to draw.")
@click.option("--negative-prompt", default=None, help="What to steer away from (true CFG); default ' '.")
@click.option("--steps", type=int, default=None, help="Denoising steps (default 20).")
@click.option("--guidance", type=float, default=None, help="True CFG scale; <= 1 turns CFG off (default 4.0).")
@click.option("--seed", type=int, default=None, help="Noise seed (default 0).")
@click.option("--height", type=int, help="Image height; one of the bundle's resolutions.")
@click.option("--width", type=int, help="Image width; one of the bundle's resolutions.")
@click.option("--output", "output", default=None, help="PNG file to write (default image.png).")
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Resident mode: one prompt per line, or JSONL with per-line options.")
@click.option("--interactive", is_flag=True, help="Resident mode: read prompts from the terminal.")
@click.option("--tp", type=int, default=None, help="Tensor-parallel ranks to launch (must equal the bundle's tp).")
@click.option("--device", default=None,
              help="Where to run (default: the bundle's): cpu | cuda for inductor bundles; "
                   "neuron | xla-cpu for neuron bundles (xla-cpu runs the HLO on XLA:CPU).")
@click.option("--verbose", is_flag=True, help="Print a timing breakdown per image.")
@click.option("--verify-all", is_flag=True,
              help="Re-hash every weight file, not only those changed since they were last verified.")
@_friendly
def run(bundle, **options):
    """Generate images with a built bundle."""
    from qic.runtime.cli import run_cli
    run_cli(bundle, options)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@_friendly
def doctor(as_json):
    """Which back ends, devices and compilers this machine has, and why not where not."""
    from qic.cli_doctor import run_doctor
    run_doctor(as_json)


@main.command()
@click.argument("bundle", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--tp", type=int, default=None, help="Tensor-parallel ranks to launch (must equal the bundle's tp).")
@click.option("--queue", type=int, default=16, show_default=True, help="Images that may wait; more get 429.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds a request may take, queueing included (504 after).")
@click.option("--max-n", type=int, default=4, show_default=True, help="Most images one request may ask for.")
@click.option("--max-batch", type=int, default=8, show_default=True,
              help="Most compatible images run as one batch, where the bundle has graphs for it.")
@_friendly
def serve(bundle, host, port, tp, queue, timeout, max_n, max_batch):
    """Serve a bundle over HTTP with the OpenAI images API (POST /v1/images/generations)."""
    from qic.serve.cli import run_serve
    from qic.serve.settings import Settings
    run_serve(bundle, host, port, tp, Settings(queue=queue, timeout=timeout, max_n=max_n, max_batch=max_batch))


if __name__ == "__main__":
    main()
