"""neuronx-cc, the Neuron compiler, driven through its documented command line: HLO module in, NEFF out.

Facts this module relies on ([C] confirmed in the source named, [I] inferred, [U] unconfirmed):
- [C] `neuronx-cc compile <hlo.pb> --framework XLA --target {inf2,trn1,trn1n,trn2}
  [--model-type {generic,transformer,unet-inference}] [--auto-cast {none,matmult,all}]
  [--logical-nc-config|-lnc {1,2}] [--optlevel|-O {1,2,3}] [--logfile F] [--output F]`, exit status 0 on
  success (aws-neuron-sdk compiler/neuronx-cc/api-reference-guide/index.rst). The XLA input is a
  serialized HloModuleProto; its file name does not matter.
- [C] `--lnc N` is the spelling nkipy (core/compile.py) and NxDI (model_wrapper.py) pass; the docs list
  `--logical-nc-config` and `-lnc`. [I] all three are the same option.
- [C] `neuronx-cc --version` prints "NeuronX Compiler version 2.27.5334.0+f702b353" followed by Python,
  HWM and NumPy lines; tools parse it from stderr or stdout, so both are read here.
- [C] NxDI compiles transformers with `--model-type=transformer -O1 --auto-cast=none` and the Flux VAE
  decoder with `--model-type=unet-inference -O1 --auto-cast=none`; nkipy's Qwen-Image passes `--lnc 1`.

A compile runs in a private work directory beside the graph (cwd = that directory, the compiler's own
log in it), and only a finished NEFF is renamed into place, with `neff.json` recording the cache key,
compiler version, flags and command. A NEFF whose recorded key matches is reused, never recompiled.
A compile that runs past its timeout (QIC_NEURONX_CC_TIMEOUT seconds, default 6 hours) is killed with its
whole process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from qic import family
from qic.backends.neuron import NEFF_FILE
from qic.errors import CompileError, ConfigError
from qic.fsutil import file_lock, public_mode, write_json_atomic
from qic.manifest import sha256_file

COMPILER = "neuronx-cc"
TARGETS = ("inf2", "trn1", "trn1n", "trn2")
NEFF = NEFF_FILE                   # the file name every bundle folder uses too
RECORD = "neff.json"
LOG = "log-neuron-cc.txt"          # the compiler's documented default log name, kept beside the NEFF
OUTPUT = "compiler-output.txt"     # its stdout and stderr
# Options qic places itself: a component's compiler_args may not move the input, output or log.
RESERVED = ("--framework", "--output", "--logfile")
# Options documented (or used by AWS's own tools) to take a value, so `--opt value` parses as one pair.
_VALUED = {"--framework", "--target", "--model-type", "--auto-cast", "--auto-cast-type", "--native-int64",
           "--implicit-integer-downcast", "--distribution-strategy", "--logical-nc-config", "--optlevel",
           "--logfile", "--output", "--verbose", "--pipeline", "--tensorizer-options",
           "--internal-hlo2tensorizer-options", "--internal-tensorizer-opt-level"}
_ALIASES = {"-lnc": "--logical-nc-config", "--lnc": "--logical-nc-config", "-O": "--optlevel"}
_VERSION = re.compile(r"NeuronX Compiler version\s+(\S+)")
TIMEOUT_ENV = "QIC_NEURONX_CC_TIMEOUT"
# [U] How long neuronx-cc takes on the real model's graphs is unknown (never run here: docs/neuron.md).
# 6 hours is meant to be far past any healthy compile of one graph and still end a hung one the same day.
DEFAULT_TIMEOUT = 6 * 3600.0
_RUNNING: set[subprocess.Popen] = set()   # compiler processes now running, for compile_many's Ctrl-C
_RUNNING_LOCK = threading.Lock()


def compile_timeout() -> float:
    """Seconds one neuronx-cc compile may run: $QIC_NEURONX_CC_TIMEOUT, else DEFAULT_TIMEOUT."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
                          f"e.g. {TIMEOUT_ENV}={int(DEFAULT_TIMEOUT)}, or unset it for the default")
    return value


def find() -> tuple[str | None, str]:
    """(path of neuronx-cc on PATH, "") or (None, one line saying why not)."""
    path = shutil.which(COMPILER)
    if path:
        return path, ""
    return None, (f"{COMPILER} is not on PATH (it ships in the Neuron SDK's pip package neuronx-cc, "
                  "installed on Trainium hosts and DLAMI venvs)")


def version(path: str | None = None) -> str:
    """The compiler's version string, e.g. '2.27.5334.0+f702b353' (part of every NEFF's cache key)."""
    path = path or find()[0]
    if path is None:
        raise ConfigError(find()[1], "build on a Trainium host with the Neuron SDK installed")
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{path} --version could not run: {e}") from None
    m = _VERSION.search(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or not m:
        raise ConfigError(f"{path} --version exited {proc.returncode} without a 'NeuronX Compiler version' line",
                          "check the Neuron SDK install (pip show neuronx-cc)")
    return m.group(1)


def default_flags(component: str, lnc: int = 1, target: str = "trn2") -> list[str]:
    """The flags qic compiles a component with unless its compiler_args say otherwise (its --model-type: its
    definition's, qic.family.Component.neuron_model_type; an unknown component is one ConfigError line)."""
    model_type = family.component(component).neuron_model_type
    return ["--target", target, "--model-type", model_type, "-O1", "--auto-cast", "none",
            "--lnc", str(lnc)]


def component_flags(component: str, compiler_args: str | Sequence[str] | None = None, lnc: int = 1,
                    target: str = "trn2") -> list[str]:
    """Defaults merged with the component's `compiler_args` from the build config; an option given in
    both takes the config's value (the defaults' position is kept, so commands stay readable).

    `compiler_args` is a string (split like a shell would) or a list. A value that itself starts with
    '-' must be attached: --tensorizer-options='--enable-ccop-compute-overlap'.
    """
    extra = _split(compiler_args, component)
    for name, _ in extra:
        if name in RESERVED:
            raise ConfigError(f"compiler_args of {component} sets {name}, which qic places itself",
                              f"remove {name} from the config's compiler_args")
        if not name.startswith("-"):
            raise ConfigError(f"compiler_args of {component} holds a stray argument {name!r}",
                              "give options only, e.g. '--auto-cast matmult' or '--enable-saturate-infinity'")
    merged = dict(_pairs(default_flags(component, lnc, target)))
    merged.update(extra)
    target_value = merged.get("--target")
    if target_value not in TARGETS:
        raise ConfigError(f"compiler_args of {component}: --target {target_value!r} is not one of {', '.join(TARGETS)}")
    return _unparse(list(merged.items()))


def canonical_flags(flags: Sequence[str]) -> str:
    """One spelling per option set (aliases resolved, `--x=v` split, last value wins, sorted): the cache
    key must not change when the same options are written differently."""
    return " ".join(f"{k}={v}" if v is not None else k for k, v in sorted(dict(_pairs(list(flags))).items()))


def cache_key(hlo_sha256: str, compiler_version: str, flags: Sequence[str]) -> str:
    """What determines a NEFF: the HLO's bytes, the compiler's version and its canonical flags."""
    blob = json.dumps({"hlo": hlo_sha256, "compiler": compiler_version, "flags": canonical_flags(flags)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_neff(hlo_path: str | Path, out_dir: str | Path, args: Sequence[str], compiler: str | None = None,
                 compiler_version: str | None = None, timeout: float | None = None) -> Path:
    """`out_dir/model.neff` compiled from `hlo_path` with `args` (see component_flags); reused when the
    recorded key matches. Raises CompileError with the compiler's log tail on failure, and a one-line one
    when the compile runs past `timeout` seconds (None: compile_timeout()), leaving no NEFF."""
    hlo_path, out_dir = Path(hlo_path).resolve(), Path(out_dir)
    if not hlo_path.is_file():
        raise CompileError(f"{hlo_path}: HLO module not found")
    compiler = compiler or find()[0]
    if compiler is None:
        raise ConfigError(find()[1], "build on a Trainium host with the Neuron SDK installed")
    compiler_version = compiler_version or version(compiler)
    timeout = compile_timeout() if timeout is None else timeout
    hlo_sha = sha256_file(hlo_path)
    key = cache_key(hlo_sha, compiler_version, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir / f".{NEFF}.lock"):
        if cached(out_dir, key):
            return out_dir / NEFF
        return _compile(hlo_path, hlo_sha, out_dir, list(args), compiler, compiler_version, key, timeout)


def cached(out_dir: Path, key: str) -> bool:
    """A NEFF is reused only if its record names this key and its size is the one recorded."""
    try:
        record = json.loads((Path(out_dir) / RECORD).read_text())
        return record["key"] == key and (Path(out_dir) / NEFF).stat().st_size == record["bytes"]
    except (OSError, ValueError, KeyError):
        return False


def _compile(hlo_path: Path, hlo_sha: str, out_dir: Path, args: list[str], compiler: str,
             compiler_version: str, key: str, timeout: float) -> Path:
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".tmp-neff-{os.getpid()}-"))
    cmd = [compiler, "compile", str(hlo_path), "--framework", "XLA", *args, "--output", NEFF, "--logfile", LOG]
    t0 = time.perf_counter()
    try:
        with open(work / OUTPUT, "wb") as out:
            rc = _run(cmd, work, out, timeout)
        if rc != 0 or not (work / NEFF).is_file():
            kept = out_dir / "compile-failed.log"
            text = "".join((work / f).read_text(errors="replace") for f in (OUTPUT, LOG) if (work / f).is_file())
            kept.write_text(f"$ {shlex.join(cmd)}\n{text}")
            if rc is None:
                raise CompileError(f"{COMPILER} on {hlo_path} ran past its {timeout:g} s timeout and was killed; "
                                   f"log so far: {kept}",
                                   f"set {TIMEOUT_ENV} to more seconds if the graph needs longer, then rebuild")
            tail = "\n".join("  " + line for line in text.strip().splitlines()[-15:])
            why = f"exit status {rc}" if rc else "no NEFF written"
            raise CompileError(f"{COMPILER} failed on {hlo_path} ({why}); full log: {kept}\n{tail}",
                               "fix the graph or the component's compiler_args, then rebuild")
        # The old record goes first: a crash between the renames below leaves a NEFF with no record
        # (recompiled next time), never a record describing another NEFF.
        (out_dir / RECORD).unlink(missing_ok=True)
        (out_dir / "compile-failed.log").unlink(missing_ok=True)
        for name in (NEFF, LOG, OUTPUT):
            if (work / name).is_file():
                public_mode(work / name)
                os.replace(work / name, out_dir / name)
        write_json_atomic(out_dir / RECORD, {
            "key": key, "compiler": compiler_version, "flags": args, "canonical_flags": canonical_flags(args),
            "command": [COMPILER, *cmd[1:]], "hlo_sha256": hlo_sha,
            "bytes": (out_dir / NEFF).stat().st_size, "seconds": round(time.perf_counter() - t0, 2)})
        return out_dir / NEFF
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, out, timeout: float) -> int | None:
    """The compiler's exit status, or None when it ran past `timeout` seconds. It runs in a process group
    of its own, so that the whole group can be killed: neuronx-cc starts worker processes, which killing
    neuronx-cc alone would leave running. The terminal's Ctrl-C no longer reaches that group, so an
    interrupt here, or in compile_many's waiting thread, kills it too."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        return proc.wait(timeout=timeout)
    except BaseException as e:  # the timeout, Ctrl-C, any other error
        _kill_group(proc)
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            return None
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class CompileJob:
    hlo_path: Path
    out_dir: Path
    args: tuple[str, ...]


def compile_many(jobs: Sequence[CompileJob], max_workers: int | None = None, compiler: str | None = None,
                 timeout: float | None = None) -> list[Path]:
    """Compile every job, up to max_workers compiler processes at once; NEFF paths in job order.

    A failure does not cancel the others: all run to the end, then one CompileError lists every failure
    (with the first one's log tail), so a rebuild recompiles only what failed.
    """
    if not jobs:
        return []
    compiler = compiler or find()[0]
    if compiler is None:
        raise ConfigError(find()[1], "build on a Trainium host with the Neuron SDK installed")
    ver = version(compiler)
    workers = max(1, min(len(jobs), max_workers or os.cpu_count() or 1))
    # Threads only wait on the compiler subprocesses; the compiles themselves run as parallel processes.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(compile_neff, j.hlo_path, j.out_dir, j.args, compiler, ver, timeout) for j in jobs]
        results, errors = [], []
        try:
            for job, fut in zip(jobs, futures):
                try:
                    results.append(fut.result())
                except CompileError as e:
                    errors.append((job, e))
        except BaseException:  # Ctrl-C arrives here, in the waiting thread: stop every compile, then re-raise
            for fut in futures:
                fut.cancel()
            with _RUNNING_LOCK:
                for proc in list(_RUNNING):
                    _kill_group(proc)
            raise
    if errors:
        lines = [f"{len(errors)} of {len(jobs)} NEFF compiles failed:"]
        lines += [f"  {job.hlo_path}: {e.message.splitlines()[0]}" for job, e in errors]
        first = errors[0][1].message.splitlines()[1:]
        raise CompileError("\n".join(lines + (["first failure's log tail:", *first] if first else [])),
                           errors[0][1].hint)
    return results


def _split(args: str | Sequence[str] | None, component: str) -> list[tuple[str, str | None]]:
    if args is None:
        return []
    if isinstance(args, str):
        try:
            args = shlex.split(args)
        except ValueError as e:
            raise ConfigError(f"compiler_args of {component}: {e}") from None
    return _pairs([str(a) for a in args])


def _pairs(tokens: list[str]) -> list[tuple[str, str | None]]:
    """Command-line tokens as (canonical option, value or None) pairs, in order."""
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        name, value = (tok.split("=", 1) + [None])[:2] if tok.startswith("--") else (tok, None)
        if tok.startswith("-O") and len(tok) > 2 and tok[2:].isdigit():
            name, value = "-O", tok[2:]
        name = _ALIASES.get(name, name)
        if value is None and i + 1 < len(tokens) and (
                name in _VALUED or (name.startswith("-") and not tokens[i + 1].startswith("-"))):
            value, i = tokens[i + 1], i + 1
        out.append((name, value))
        i += 1
    return out


def _unparse(pairs: list[tuple[str, str | None]]) -> list[str]:
    out = []
    for name, value in pairs:
        if name == "--optlevel" and value is not None:
            out.append(f"-O{value}")
        elif name == "--logical-nc-config":
            out += ["--lnc", str(value)]
        elif value is not None and value.startswith("-"):
            out.append(f"{name}={value}")   # a value that looks like an option must stay attached
        else:
            out += [name] if value is None else [name, value]
    return out
