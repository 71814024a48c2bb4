"""Nothing hangs (issue 29): every process group qic makes has qic's timeout, and a rank that dies mid-loop makes
its peers fail by themselves within it, the one-line error naming the dead rank first.

Eager, through qic's own split graphs (EagerModel with the layout, ranks spawned on gloo, as
tests/test_step_cache_layouts.py runs them), with step caching on: the tiny random checkpoint at 48x80, one
bucket. The ranks of the parent killed by SIGKILL are in tests/test_serve.py (qic serve) and below (qic run).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from qic.parallel.mesh import Layout
from qic.parallel.ranks import REPORT_GRACE_S, RankFailure, spawn
from tests.conftest import QIC, ROOT, TINY_RES
from tests.helpers import assert_die_with

pytestmark = pytest.mark.slow   # spawns ranks and kills them

BUCKET, STEPS, KILL_AT = 129, 8, 4     # the victim dies at its 4th denoise step: past step caching's warm-up
PG_TIMEOUT_S = 3.0
# A peer notices a dead rank from its closed connection at once, or from a store or collective timing out
# (PG_TIMEOUT_S); then it reports and exits, and the spawner, polling every 0.2 s, sees it: 3 s is room for that
# on two loaded cores, and below REPORT_GRACE_S, so a peer the spawner had to kill would not pass.
REPORT_S = 3.0


def _dies_mid_loop(rank: int, world: int, root: str, layout: Layout, guidance: float, victim: int, work: str):
    """Step-cached denoising under `layout`; rank `victim` is SIGKILLed at its KILL_AT-th step (it writes the
    time first). Each rank records its process groups' timeouts before the loop."""
    import torch
    import torch.distributed as dist

    from qic.builder.eager import EagerModel
    from qic.parallel.ranks import group_timeout
    from qic.runtime.generate import Request, generate_batch
    model = EagerModel(root, [TINY_RES], [BUCKET], layout=layout, rank=rank, step_cache=(1, 0))
    groups = list(dist.distributed_c10d._world.pg_map)
    Path(work, f"timeouts-{rank}.json").write_text(json.dumps([group_timeout(g).total_seconds() for g in groups]))
    if rank == victim:
        graph, steps = model.graph, [0]
        model.graph = lambda *a, **kw: _Dying(graph(*a, **kw), steps, work) if kw.get("part") == "head" else \
            graph(*a, **kw)
    torch.manual_seed(0)
    generate_batch(model, [Request("a small red cube", steps=STEPS, seed=5, guidance=guidance, cache_threshold=1.25)])


class _Dying:
    """The head graph (its `inputs` too); the KILL_AT-th call of it SIGKILLs this process, as the OOM killer would."""

    def __init__(self, graph, steps: list, work: str):
        self._graph, self._steps, self._work = graph, steps, work

    def __getattr__(self, name):
        return getattr(self._graph, name)

    def __call__(self, *tensors):
        self._steps[0] += 1
        if self._steps[0] == KILL_AT:
            Path(self._work, "killed-at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self._graph(*tensors)


# (layout, guidance, victim): CFG-parallel, each group deciding its branch; Ulysses, the figure summed over the
# sequence group; CFG-parallel without CFG, the idle group polling the store while the working rank 0 dies.
CASES = [(Layout(1, 1, 2), 4.0, 1), (Layout(1, 2, 1), 4.0, 1), (Layout(1, 1, 2), 1.0, 0)]


@pytest.mark.parametrize("layout, guidance, victim", CASES,
                         ids=["CFG-parallel", "Ulysses", "CFG-parallel-idle-peer"])
def test_a_killed_rank_fails_its_peers_within_the_timeout_naming_it(layout, guidance, victim, tiny_ckpt, tmp_path):
    with pytest.raises(RankFailure) as info:
        spawn(_dies_mid_loop, layout.world, str(tiny_ckpt), layout, guidance, victim, str(tmp_path), timeout=300,
              pg_timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    after = time.time() - float((tmp_path / "killed-at").read_text())
    message = str(info.value)
    print(f"{layout.describe()}, guidance {guidance}: {after:.2f} s after the kill: {message}")
    assert "\n" not in message
    assert message.startswith(f"tensor-parallel run failed: rank {victim}: exited with code -9 (SIGKILL)"), message
    for o in info.value.outcomes:
        if o.rank != victim:   # failed in its own wait, not killed by the spawner at the grace deadline
            assert not o.ok and "no result within" not in o.error, o
    assert after < PG_TIMEOUT_S + REPORT_S < PG_TIMEOUT_S + REPORT_GRACE_S
    for r in range(layout.world):   # the world, the layout's axis groups and the host's: all of them qic's timeout
        timeouts = json.loads((tmp_path / f"timeouts-{r}.json").read_text())
        assert len(timeouts) >= 4 and set(timeouts) == {PG_TIMEOUT_S}, timeouts


def _writes_to_stderr(rank: int, world: int, fail: bool):
    """Both ways a rank writes to stderr: Python's sys.stderr and file descriptor 2 (where C++ writes). With
    `fail`, rank 1 raises at once and rank 0 writes once more after that."""
    import sys
    print(f"rank {rank}: python", file=sys.stderr, flush=True)
    os.write(2, f"rank {rank}: fd 2\n".encode())
    if fail and rank == 1:
        raise ValueError("rank 1 fails")
    if fail:
        time.sleep(1.0)
        os.write(2, b"rank 0: after rank 1 failed\n")
    return rank


def test_a_rank_s_stderr_reaches_ours(capfd):
    assert spawn(_writes_to_stderr, 2, False, timeout=120) == [0, 1]
    err = capfd.readouterr().err
    for line in ("rank 0: python", "rank 0: fd 2", "rank 1: python", "rank 1: fd 2"):
        assert line in err.splitlines(), err


def test_what_ranks_print_after_a_failure_is_kept_apart_from_the_one_line_error(capfd):
    """The peers' reaction to a rank's death (gloo's and the AOTInductor runtime's C++ warnings) would surround
    qic's one line: from the first failure on, the ranks' stderr stays in their files, which the error names."""
    with pytest.raises(RankFailure) as info:
        spawn(_writes_to_stderr, 2, True, timeout=120)
    message, err = str(info.value), capfd.readouterr().err
    assert "after rank 1 failed" not in err, err
    assert message.startswith("tensor-parallel run failed: rank 1: ValueError: rank 1 fails") and "\n" not in message
    assert message.endswith(f" (the ranks' stderr: {info.value.stderr_dir})"), message
    assert "rank 0: after rank 1 failed" in (info.value.stderr_dir / "rank0.stderr").read_text()


def test_every_process_group_is_made_through_qics_helper():
    """torch gives a group made without a timeout 30 minutes: every new_group in qic goes through
    qic.parallel.ranks.new_group, and init_process_group is called with a timeout (the fake tracing world's
    collectives never wait)."""
    offenders = []
    for path in sorted((ROOT / "qic").rglob("*.py")):
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if rel != "qic/parallel/ranks.py":
            offenders += [f"{rel}: {m.group(0)}" for m in re.finditer(r"\bdist\.new_group\(", text)]
        for call in re.finditer(r"init_process_group\((?:[^()]|\([^()]*\))*\)", text):   # one level of nesting
            if "timeout=" not in call.group(0) and '"fake"' not in call.group(0):
                offenders.append(f"{rel}: {call.group(0)}")
    assert not offenders, offenders


def test_qic_run_killed_leaves_no_rank_behind(bundle_tp2, tmp_path):
    """SIGKILL of `qic run` (the OOM killer) while its ranks load and denoise: the ranks die with it, at once.
    The ranks are forks of `qic run` (its command line, not a fresh interpreter's: qic.runtime.launch)."""
    proc = subprocess.Popen([*QIC, "run", str(bundle_tp2), "--prompts-file", _prompts(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while not _joined(parent):   # past start-up: the parent-death signal, not the start-up check, ends them
            assert proc.poll() is None and time.monotonic() < deadline, "qic run's ranks did not join"
            time.sleep(0.1)
        ranks = [k for k in parent.children() if "resource_tracker" not in " ".join(k.cmdline())]
        assert all(k.cmdline() == parent.cmdline() for k in ranks), [k.cmdline() for k in ranks]
        assert_die_with(proc, within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "a red bicycle", "seed": s, "steps": 2, "output": str(tmp_path / f"{s}.png")}
             for s in range(50)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _joined(parent: psutil.Process) -> bool:
    """Both ranks of `qic run` (multiprocessing's resource tracker aside) hold a connection: they have joined
    the process group, so they run qic's code."""
    ranks = [k for k in parent.children() if "resource_tracker" not in " ".join(k.cmdline())]
    return len(ranks) == 2 and all(k.net_connections("tcp") for k in ranks)

