"""The `qic` command: thin click commands, each calling one function of its verb's module (qic/cli/<verb>.py),
imported lazily. The command functions are named <verb>_command so that they never shadow those modules.

Errors users can fix print as one line plus the fix, never a traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from functools import wraps

import click


def debugging() -> bool:
    """--debug or QIC_DEBUG=1: failures show their traceback (the flag sets the variable, so spawned ranks
    and torchrun's see it too)."""
    return os.environ.get("QIC_DEBUG", "") not in ("", "0")


def _friendly(fn):
    """The CLI's one error path: whatever reaches the top prints as `error: ...` (and `fix: ...`) and exits 2;
    the traceback only under --debug. Writes are atomic (qic.fsutil), so a failure leaves nothing half-written."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        from qic.errors import QicError
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise   # click's own usage errors and exits already print one line
        except Exception as e:
            if debugging():
                raise
            message, hint = _explain(e, QicError)
            click.echo(f"error: {message}", err=True)
            if hint:
                click.echo(f"  fix: {hint}", err=True)
            sys.exit(2)
    return wrapper


def _explain(e: Exception, user_error: type) -> tuple[str, str | None]:
    """(one line, a fix) for any failure: our own errors say both; the system's say which file and why."""
    if isinstance(e, user_error):
        return e.message, e.hint
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        reason = e.strerror or str(e) or type(e).__name__
        hints = {errno.ENOSPC: "free some disk space (nothing half-written was kept) and rerun",
                 errno.EDQUOT: "free some disk space (nothing half-written was kept) and rerun",
                 errno.EACCES: "choose a path you can write to, or fix its permissions",
                 errno.EROFS: "choose a path on a writable file system"}
        return f"{where}{reason}", hints.get(e.errno)
    text = str(e).splitlines()[0] if str(e) else ""
    return (f"internal error: {type(e).__name__}{': ' + text if text else ''}",
            "rerun with --debug (or QIC_DEBUG=1) for the traceback, and report it")


@click.group()
@click.version_option(package_name="qic")
@click.option("--debug", is_flag=True, help="Show the traceback of any failure (also: QIC_DEBUG=1).")
def main(debug):
    """qic: compile Qwen-Image checkpoints into ready-to-run bundles, and run them."""
    if debug:
        os.environ["QIC_DEBUG"] = "1"


_BUILD_OPTIONS = [
    click.option("--model", help="Checkpoint: a local diffusers-layout directory or a hub id "
                                 "(default: embedded:shapes, the trained tiny model)."),
    click.option("--backend", help="inductor | neuron | export (torch.export programs run by torch: no compile)"),
    click.option("--device", help="cpu | cuda (inductor), neuron, cpu (export)"),
    click.option("--tp", type=int, help="Tensor-parallel degree."),
    click.option("--ulysses", type=int, help="Ulysses sequence-parallel degree of the denoiser (world = tp x "
                                             "ulysses x 2 with --cfg-parallel)."),
    click.option("--cfg-parallel", is_flag=True, default=None,
                 help="The cond and uncond rows of true CFG on two rank groups (doubles the world)."),
    click.option("--resolution", "resolutions", multiple=True,
                 help="HxW or an aspect preset (1:1 16:9 9:16 4:3 3:4 3:2 2:3), repeatable; replaces the config's "
                      "list."),
    click.option("--condition-size", "condition_sizes", multiple=True,
                 help="HxW a reference (condition) image is resized to, VAE side (repeatable): a vision-tower and a "
                      "VAE-encoder graph each (Qwen-Image-2.1; replaces the config's list)."),
    click.option("--condition-images", type=int,
                 help="Most condition images one request holds (default 1 with --condition-size)."),
    click.option("--text-buckets", help="Text-encoder lengths: one (128), a list (72,128), or 0 for exact length "
                                        "(the default of one-rank, batch-1 text-to-image CPU builds where the "
                                        "family and back end take it; else 128)."),
    click.option("--text-bucket-step", type=int, help="Buckets every N tokens (N, 2N, ... up to the longest prompt)."),
    click.option("--batch-sizes", help="Images per graph call to build graphs for, e.g. 1,2 (qic serve batches "
                                       "compatible requests in these sizes); default 1."),
    click.option("--step-cache", help="Step caching's split graphs: Fn,Bn blocks always computed first and last "
                 "(1,0: diffusers' FirstBlockCache; 8,0: cache-dit's DBCache default)."),
    click.option("--components", help="Comma-separated subset of text_encoder,denoiser,vae_decoder."),
    click.option("--layers", type=click.Choice(["unrolled", "looped"]),
                 help="Transformer blocks unrolled in the graph, or one block looped over stacked weights."),
    click.option("--lora", "loras", multiple=True,
                 help="FILE[:SCALE]: a LoRA merged into the denoiser's weights (repeatable; replaces the config's "
                      "list)."),
    click.option("--lora-slots", type=int,
                 help="R: the denoiser's graphs take LoRA adapters of total rank <= R as inputs, so `qic run --lora` "
                      "and `qic serve --lora` pick adapters and strengths per request (0: none)."),
    click.option("--cpu-target", help="inductor: CPU code for portable (default: x86-64-v3, AVX2), auto, "
                                      "x86-64-v3, x86-64-v4, or native (-march=native: this host's every flag)."),
    click.option("--output", help="Bundle directory to write."),
    click.option("--cache-dir", help="Shard and compile cache directory."),
    click.option("--cache-from", help="Remote compile store to pull hits from: hf://ORG/REPO or a directory."),
    click.option("--cache-public-key", "cache_public_keys", multiple=True,
                 help="Public key (hex or .pub file) whose signatures make remote entries usable; repeatable."),
    click.option("--cache-trusted", is_flag=True, default=None, help="Use the remote store's entries unsigned."),
]


def _build_options(fn):
    for option in reversed(_BUILD_OPTIONS):
        fn = option(fn)
    return fn


def _overrides(resolutions, loras=(), cache_public_keys=(), condition_sizes=(), **flags) -> dict:
    """Flag values as spec overrides: repeatable flags given no value leave the config's list alone."""
    return {**flags, "resolutions": list(resolutions) or None, "loras": list(loras) or None,
            "cache_public_keys": list(cache_public_keys) or None, "condition_sizes": list(condition_sizes) or None}


# How a bundle is loaded, the same for `qic run` and `qic serve` (qic.runtime.bundle.Bundle's arguments).
_LOAD_OPTIONS = [
    click.option("--device", default=None,
                 help="Where to run (default: the bundle's): cpu | cuda for inductor bundles; "
                      "neuron | xla-cpu for neuron bundles (xla-cpu runs the HLO on XLA:CPU); cpu for export bundles."),
    click.option("--weights", "weights_from", type=click.Path(file_okay=False),
                 help="Run with another bundle's weights (same architecture: e.g. Qwen-Image-2512, a LoRA build)."),
    click.option("--verify-all", is_flag=True,
                 help="Re-hash every weight file, not only those changed since they were last verified."),
]


def _run_option_flags(fn):
    """qic run's per-image flags, one per row of qic.host.options (default None: not given, so the row's or
    the bundle's default applies where the request is made)."""
    from qic.host.options import FLAG, given_at
    for option in reversed(given_at(FLAG)):
        if option.kind is bool:   # --name / --no-name
            flags = f"{option.flag}/--no-{option.flag[2:]}"
            fn = click.option(flags, option.name, default=None, help=option.help)(fn)
        elif option.kind is list:   # repeated; not given: None, as every other flag
            fn = click.option(option.flag, option.name, multiple=True, help=option.help,
                              callback=lambda ctx, param, value: list(value) or None)(fn)
        else:
            fn = click.option(option.flag, option.name, type=option.kind, default=None, help=option.help)(fn)
    return fn


def _load_options(fn):
    for option in reversed(_LOAD_OPTIONS):
        fn = option(fn)
    return fn


# qic serve's --weights: repeatable, BUNDLE as qic run's, or NAME=BUNDLE, a weight set served as a model of its own.
_SERVE_WEIGHTS = click.option(
    "--weights", "weights_from", multiple=True,
    help="BUNDLE: run with another bundle's weights, as qic run's --weights. NAME=BUNDLE (repeatable): also serve "
         "that bundle's weights through the same graphs as model NAME (a request's `model` picks it; /v1/models "
         "lists them). NAME=DIR: a checkpoint folder, cut into a weight set for the graphs first (--cache-dir).")


def _serve_load_options(fn):
    """_load_options with qic serve's --weights in place of qic run's."""
    device, _, verify_all = _LOAD_OPTIONS
    for option in (verify_all, _SERVE_WEIGHTS, device):
        fn = option(fn)
    return fn


@main.command("build")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_build_options
@click.option("--jobs", type=int, default=None,
              help="Compile up to K graphs side by side in worker processes (default: one per core, as free "
                   "memory allows; $QIC_COMPILE_JOBS).")
@click.option("--weights-for", type=click.Path(file_okay=False),
              help="BUNDLE: compile nothing; cut --model's weights for BUNDLE's graphs into a weight set at --output "
                   "(run as qic run BUNDLE --weights OUTPUT, or served with qic serve BUNDLE --weights NAME=OUTPUT).")
@_friendly
def build_command(config, resolutions, jobs, weights_for, **flags):
    """Shard, compile and bundle a checkpoint (CONFIG: a YAML build config; default: the trained embedded:shapes)."""
    if weights_for:
        from qic.cli.build import run_weight_set
        return run_weight_set(weights_for, config, _overrides(resolutions, **flags), jobs)
    from qic.cli.build import run_build
    run_build(config, _overrides(resolutions, **flags), jobs)


@main.command("plan")
@click.argument("config", required=False, type=click.Path())
@_build_options
@_friendly
def plan_command(config, resolutions, **flags):
    """Memory, disk and compile-time plan of a build, from configs alone (CONFIG: a YAML build config, or a
    checkpoint directory, which may hold only its config files)."""
    from qic.cli.plan import run_plan
    run_plan(config, _overrides(resolutions, **flags))


@main.command("warm")
@click.argument("matrix", type=click.Path(dir_okay=False))
@click.option("--shard", help="I/N: compile only this worker's share of the jobs (1-based).")
@click.option("--dry-run", is_flag=True, help="List what would compile and what is cached; compile nothing.")
@click.option("--jobs", type=int, default=1, show_default=True, help="Compile in K worker processes.")
@click.option("--cache-dir", help="The compile cache (store) to fill; replaces the matrix's cache_dir.")
@click.option("--model", help="Replaces the matrix's model (e.g. a local directory of configs).")
@click.option("--sign-key", envvar="QIC_SIGNING_KEY", type=click.Path(dir_okay=False),
              help="Ed25519 private key (PEM) to sign the entries compiled [env QIC_SIGNING_KEY].")
@click.option("--report", type=click.Path(dir_okay=False), help="Also write the results as JSON here.")
@_friendly
def warm_command(matrix, shard, dry_run, jobs, cache_dir, model, sign_key, report):
    """Fill a compile cache from MATRIX (a build config whose keys may hold lists), from configs alone."""
    from qic.cli.warm import run_warm
    run_warm(matrix, {"cache_dir": cache_dir, "model": model}, shard, jobs, dry_run, sign_key, report)


@main.group("cache")
def cache_group():
    """Inspect and maintain a compile cache directory."""


@cache_group.command("ls")
@click.argument("cache_dir", type=click.Path(file_okay=False))
@_friendly
def cache_ls(cache_dir):
    """List everything a compile cache holds, by kind, with sizes."""
    from qic.cli.cache import run_cache_ls
    run_cache_ls(cache_dir)


@cache_group.command("verify")
@click.argument("cache_dir", type=click.Path(file_okay=False))
@_friendly
def cache_verify(cache_dir):
    """Hash every entry's files; exit 1 if any entry is incomplete or damaged."""
    from qic.cli.cache import run_cache_verify
    run_cache_verify(cache_dir)


@cache_group.command("prune")
@click.argument("cache_dir", type=click.Path(file_okay=False))
@click.option("--max-size", help="Remove least recently used entries until the cache fits this size (e.g. 20G).")
@click.option("--older-than", help="Remove entries unused for longer than this (e.g. 7d, 12h, 30m).")
@_friendly
def cache_prune(cache_dir, max_size, older_than):
    """Remove unused entries of every kind (graphs, shards, NEFFs, memos, plans, locks, dead writers'
    leftovers), least recently used first, never one a running build holds; give --max-size, --older-than
    or both."""
    from qic.cli.cache import run_cache_prune
    run_cache_prune(cache_dir, max_size, older_than)


@cache_group.command("push")
@click.argument("cache_dir", type=click.Path(file_okay=False))
@click.argument("url")
@_friendly
def cache_push(cache_dir, url):
    """Publish a cache directory's intact entries to hf://ORG/REPO (uploads, then one commit)."""
    from qic.cli.cache import run_cache_push
    run_cache_push(cache_dir, url)


@cache_group.command("pull")
@click.argument("url")
@click.argument("cache_dir", type=click.Path(file_okay=False))
@click.option("--public-key", "public_keys", multiple=True, help="Public key (hex or .pub file) entries must be "
              "signed with; repeatable.")
@click.option("--trusted", is_flag=True, help="Use the store's entries unsigned.")
@click.option("--device", default="cpu", show_default=True, help="Pull the entries compiled for this machine and "
              "device (inductor: cpu | cuda).")
@_friendly
def cache_pull(url, cache_dir, public_keys, trusted, device):
    """Fetch hf://ORG/REPO's entries for this machine into a cache directory, verified and signed."""
    from qic.cli.cache import run_cache_pull
    run_cache_pull(url, cache_dir, public_keys, trusted, device)


@cache_group.command("keygen")
@click.argument("keyfile", type=click.Path(dir_okay=False))
@_friendly
def cache_keygen(keyfile):
    """Make an Ed25519 signing key (KEYFILE, keep it secret) and its public key (KEYFILE.pub)."""
    from qic.cli.cache import run_cache_keygen
    run_cache_keygen(keyfile)


@main.command("inspect")
@click.argument("bundle", type=click.Path())
@click.option("--verify", is_flag=True,
              help="Re-hash every weight file, not only those changed since they were last verified.")
@_friendly
def inspect_command(bundle, verify):
    """Print a bundle's manifest and check every file's hash."""
    from qic.cli.inspect import run_inspect
    run_inspect(bundle, full=verify)


@main.command("run")
@click.argument("bundle", type=click.Path())
@_run_option_flags
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Resident mode: one prompt per line, or JSONL with per-line options.")
@click.option("--interactive", is_flag=True, help="Resident mode: read prompts from the terminal.")
@click.option("--tp", type=int, default=None, help="Tensor-parallel ranks to launch (must equal the bundle's tp).")
@_load_options
@click.option("--verbose", is_flag=True, help="Print a timing breakdown per image.")
@_friendly
def run_command(bundle, **options):
    """Generate images with a built bundle."""
    from qic.cli.run import run_cli
    run_cli(bundle, options)


@main.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@_friendly
def doctor_command(as_json):
    """Which back ends, devices and compilers this machine has, and why not where not."""
    from qic.cli.doctor import run_doctor
    run_doctor(as_json)


@main.command("serve")
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
@_serve_load_options
@click.option("--weights-budget", type=float, default=None,
              help="GiB of named weight sets (--weights NAME=BUNDLE_OR_DIR) kept mapped at once; past it the least "
                   "recently used is unmapped (default: all stay).")
@click.option("--lora", "loras", multiple=True,
              help="NAME=FILE: a LoRA adapter requests may name in their `lora` field, with a scale each (a bundle "
                   "built with --lora-slots; any format qic build --lora reads); repeatable.")
@click.option("--lora-budget", type=float, default=None,
              help="GiB of adapter matrices kept in memory; past it the least recently used is read again when next "
                   "named (default: all stay).")
@click.option("--cache-dir", default="artifacts/cache", show_default=True,
              help="Where a checkpoint folder given as --weights NAME=DIR is cut into a weight set for the bundle's "
                   "graphs (kept for the next start).")
@_friendly
def serve_command(bundle, host, port, tp, queue, timeout, max_n, max_batch, weights_budget, loras, lora_budget,
                  cache_dir, **load):
    """Serve a bundle over HTTP with the OpenAI images API (POST /v1/images/generations)."""
    from qic.cli.serve import run_serve
    from qic.errors import ConfigError
    from qic.serve.settings import Settings, parse_adapters
    from qic.serve.weight_sets import as_weight_sets, parse_weights
    load["weights_from"], named = parse_weights(load.get("weights_from"), os.path.basename(os.path.realpath(bundle)))
    adapters = parse_adapters(loras)
    if lora_budget is not None and not lora_budget > 0:
        raise ConfigError("--lora-budget must be a positive number of GiB")
    if weights_budget is not None and not weights_budget > 0:
        raise ConfigError("--weights-budget must be a positive number of GiB")
    if weights_budget is not None and not named:
        raise ConfigError("--weights-budget keeps named weight sets mapped, and none is given",
                          "add --weights NAME=BUNDLE, or drop --weights-budget")
    named = as_weight_sets(named, bundle, cache_dir)
    run_serve(bundle, host, port, tp, Settings(queue=queue, timeout=timeout, max_n=max_n, max_batch=max_batch), load,
              {"named": named, "budget": None if weights_budget is None else weights_budget * 2**30,
               "loras": adapters, "lora_budget": None if lora_budget is None else lora_budget * 2**30})

