"""`qic run`: one image, or resident modes (prompts file, interactive) that pay the load once."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from qic.errors import ConfigError
from qic.host.cache_policy import computed_line
from qic.host.options import BY_NAME, FLAG, LINE, given_at, untaken
from qic.manifest import read_bundle
from qic.parallel.ranks import init_from_env
from qic.runtime.bundle import Bundle
from qic.runtime.heap import keep_freed_blocks
from qic.runtime.launch import bundle_world, spawn_ranks, torchrun_world
from qic.runtime.png import save_png
from qic.runtime.programs import program_of

_OPTION_KEYS = tuple(o.name for o in given_at(FLAG))   # qic.host.options: the per-image flags and line keys
_LINE_KEYS = tuple(o.name for o in given_at(LINE))


def run_cli(bundle_path: str, options: dict) -> None:
    """Check everything that can be checked before any rank starts, then serve on 1 or N ranks."""
    modes = sum(bool(x) for x in (options.get("prompt"), options.get("prompts_file"), options.get("interactive")))
    if modes != 1:
        raise ConfigError("give exactly one of --prompt, --prompts-file, --interactive")
    lines = _read_prompts(Path(options["prompts_file"])) if options.get("prompts_file") else [{}]
    ranks = bundle_world(bundle_path, options.get("tp"), "run")
    program = program_of(read_bundle(Path(bundle_path)))
    base = {k: v for k, v in options.items() if k in _OPTION_KEYS and v is not None}
    _refuse_untaken(program, base, None)
    for n, line in enumerate(lines, 1):
        _refuse_untaken(program, line, f"{options.get('prompts_file')}, prompt {n}")
    keep_freed_blocks()   # before any rank is forked or anything loaded: every rank's steps reuse their buffers
    world = torchrun_world()
    if world is not None:  # launched by torchrun: this process is one rank
        if options.get("interactive"):
            # Each rank would read its own terminal line: ranks would run different prompts and hang.
            raise ConfigError("--interactive runs one process; torchrun started ranks",
                              "use --prompts-file under torchrun, or run `qic run --interactive` without it")
        if world != ranks:
            raise ConfigError(f"torchrun started {world} rank(s); the bundle's layout runs on {ranks}",
                              f"use torchrun with {ranks} ranks in all (e.g. --nproc-per-node {ranks})")
        rank, world, _ = init_from_env()
        serve(bundle_path, options, rank, world)
    elif ranks == 1:
        serve(bundle_path, options, 0, 1)
    else:
        if options.get("interactive"):
            raise ConfigError("--interactive runs one rank; use --prompts-file with a tensor-parallel bundle")
        spawn_ranks(serve, ranks, bundle_path, options, timeout=7 * 24 * 3600.0)


def serve(bundle_path_or_rank, *args) -> None:
    """One rank's work: load once, then every prompt. Only rank 0 writes files and prints."""
    if isinstance(bundle_path_or_rank, int):  # spawned: (rank, world, bundle_path, options)
        rank, world, bundle_path, options = bundle_path_or_rank, *args
    else:
        bundle_path, options, rank, world = bundle_path_or_rank, *args
    base = {k: v for k, v in options.items() if k in _OPTION_KEYS and v is not None}
    clock = _LoadClock()
    bundle = Bundle(bundle_path, device=options.get("device"), rank=rank, world=world,
                    verify_all=bool(options.get("verify_all")), weights_from=options.get("weights_from"))
    verbose = options.get("verbose")
    lead = rank == 0
    if options.get("prompt"):
        _one(bundle, base, 0, clock.take(), verbose, lead=lead)
    elif options.get("prompts_file"):
        for i, line_opts in enumerate(_read_prompts(Path(options["prompts_file"]))):
            _one(bundle, {**base, **line_opts}, i, clock.take(), verbose, resident=True, lead=lead)
    else:
        i = 0
        print("qic interactive: type a prompt, or an empty line to quit.", file=sys.stderr)
        while True:
            try:
                prompt = input("prompt> ").strip()
            except EOFError:
                break
            if not prompt:
                break
            _one(bundle, {**base, "prompt": prompt}, i, clock.take(), verbose, resident=True)
            i += 1


def _refuse_untaken(program, opts: dict, line: str | None) -> None:
    """An option the bundle's host program has no Request field for is one line naming it (a step-caching flag on
    a Qwen-Image-2.1 bundle, say), never dropped. Options at their table default (negative prompt ' ', seed 0) are
    what qic run passes when none is given; `output` is qic run's own."""
    fields = program.Request.__dataclass_fields__
    refused = untaken(program.Request, opts)
    if refused:
        where = f"{line}: key {refused[0]!r}" if line else BY_NAME[refused[0]].flag
        takes = ", ".join(BY_NAME[k].flag for k in fields if k in BY_NAME and k != "prompt")
        raise ConfigError(f"{where}: this bundle's host program ({program.__name__}) takes no such option",
                          f"drop it; this bundle's runs take {takes}")


class _LoadClock:
    """Seconds spent loading bundles since the previous prompt: the first prompt carries the load, the
    rest carry whatever was measured meanwhile (nothing, unless something reloaded)."""

    def __init__(self):
        self.seen = Bundle.seconds_loading

    def take(self) -> float:
        now = Bundle.seconds_loading
        spent, self.seen = now - self.seen, now
        return spent


def _one(bundle: Bundle, opts: dict, index: int, load: float, verbose: bool, resident: bool = False,
         lead: bool = True) -> None:
    output = opts.pop("output", None) or "image.png"
    if resident:
        p = Path(output)
        output = str(p.with_name(f"{p.stem}-{index:03d}{p.suffix or '.png'}"))
    program = program_of(bundle.manifest)   # the bundle's family's host program (qic.runtime.programs)
    req = program.Request(**{k: v for k, v in opts.items() if k in program.Request.__dataclass_fields__})
    result = program.generate(bundle, req)
    if not lead:
        return
    t = time.perf_counter()
    path = save_png(result, bundle.id, output, bundle.weights_id)
    result.timings["save"] = time.perf_counter() - t
    print(f"wrote {path}")
    if verbose:
        # Stages as the program ran them (text-to-image: tokenize, encode, step<i>..., decode), then save.
        parts = [f"load {load:.3f}s"] + [f"{k} {v:.3f}s" for k, v in result.timings.items()]
        print("timing: " + ", ".join(parts))
        if getattr(result, "computed", None) is not None:
            print("step cache: " + computed_line(result.computed, req.steps))


def _read_prompts(path: Path) -> list[dict]:
    """Plain lines are prompts; lines starting with '{' are JSON objects with per-line options."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompts file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})", "save the prompts file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the prompts file ({e.strerror or e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            except RecursionError:
                raise ConfigError(f"{path}:{n}: invalid JSON (nested too deeply)") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{path}:{n}: a line starting with '{{' must be a JSON object")
            unknown = sorted(set(obj) - set(_LINE_KEYS))
            if unknown or "prompt" not in obj:
                raise ConfigError(f"{path}:{n}: " + (f"unknown key {unknown[0]!r}" if unknown else "no 'prompt'")
                                  + f"; allowed keys: {', '.join(_LINE_KEYS)}")
            for key, value in obj.items():   # each by its row: "3" is not a seed, 3.5 not a step count, true not 1
                BY_NAME[key].check(value, f"{path}:{n}")
            out.append(obj)
        else:
            out.append({"prompt": line})
    if not out:
        raise ConfigError(f"{path}: no prompts in the file")
    return out
