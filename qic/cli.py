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


_BUILD_OPTIONS = [
    click.option("--model", help="Checkpoint: a local diffusers-layout directory or a hub id "
                                 "(default: embedded tiny)."),
    click.option("--backend", help="inductor | neuron"),
    click.option("--device", help="cpu | cuda (inductor), neuron"),
    click.option("--tp", type=int, help="Tensor-parallel degree."),
    click.option("--resolution", "resolutions", multiple=True, help="HxW, repeatable; replaces the config's list."),
    click.option("--text-buckets", help="Comma-separated lengths, a step (e.g. 64), or 0 for exact length."),
    click.option("--components", help="Comma-separated subset of text_encoder,denoiser,vae_decoder."),
    click.option("--layers", type=click.Choice(["unrolled", "looped"]),
                 help="Transformer blocks unrolled in the graph, or one block looped over stacked weights."),
    click.option("--output", help="Bundle directory to write."),
    click.option("--cache-dir", help="Shard and compile cache directory."),
]


def _build_options(fn):
    for option in reversed(_BUILD_OPTIONS):
        fn = option(fn)
    return fn


def _overrides(resolutions, **flags) -> dict:
    return {**flags, "resolutions": list(resolutions) or None}


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_build_options
@_friendly
def build(config, resolutions, **flags):
    """Shard, compile and bundle a checkpoint (CONFIG: a YAML build config; default configs/tiny.yaml)."""
    from qic.cli_build import run_build
    run_build(config, _overrides(resolutions, **flags))


@main.command()
@click.argument("config", required=False, type=click.Path())
@_build_options
@_friendly
def plan(config, resolutions, **flags):
    """Memory, disk and compile-time plan of a build, from configs alone (CONFIG: a YAML build config, or a
    checkpoint directory, which may hold only its config files)."""
    from qic.cli_plan import run_plan
    run_plan(config, _overrides(resolutions, **flags))


@main.command()
@click.argument("bundle", type=click.Path())
@_friendly
def inspect(bundle):
    """Print a bundle's manifest and verify every file's hash."""
    from qic.cli_inspect import run_inspect
    run_inspect(bundle)


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
@click.option("--verbose", is_flag=True, help="Print a timing breakdown per image.")
@_friendly
def run(bundle, **options):
    """Generate images with a built bundle."""
    from qic.runtime.cli import run_cli
    run_cli(bundle, options)


if __name__ == "__main__":
    main()
