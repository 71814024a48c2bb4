"""A device that runs a multi-rank bundle's graphs in lockstep (the neuron back end's XLA:CPU runner: rank 0 runs
every rank's graph as one program, qic.backends.lockstep) refuses, in one line and before any rank waits, the
runs whose CFG groups would call different graphs: step caching by threshold (each group decides its own steps)
and guidance <= 1 with one image (CFG group 1 idles). What keeps the ranks in step still runs: a static step mask.

The ranks here are the eager stand-in marked lockstep, a FAKE of such a device (its graphs run eagerly, each rank
its own), spawned as the layout's two ranks: a rank that waited instead of refusing would hang the spawn past its
limit, and the test would fail."""

from __future__ import annotations

import numpy as np
import pytest

from qic.backends import lockstep
from qic.parallel.mesh import Layout
from qic.parallel.tp import spawn
from tests.conftest import TINY_RES, pixels

PROMPT, BUCKET = "a small red cube", 72


def test_lockstep_is_the_neuron_back_ends_xla_cpu_runner_only():
    assert lockstep("neuron", "xla-cpu")
    assert not lockstep("neuron", "neuron") and not lockstep("inductor", "cpu") and not lockstep("export", "cpu")


def _rank(rank: int, world: int, root: str, marked: bool):
    from qic.builder.eager import EagerModel
    from qic.errors import ConfigError
    from qic.runtime.generate import Request, generate
    model = EagerModel(root, [TINY_RES], [BUCKET], layout=Layout(1, 1, 2), rank=rank, step_cache=(1, 0))
    model.lockstep = marked
    said = []
    for req in (Request(PROMPT, steps=3, cache_threshold=0.5), Request(PROMPT, steps=3, guidance=1.0)):
        try:
            generate(model, req)
            said.append(None)
        except ConfigError as e:
            said.append(e.message)
    # One mask for both groups: the same graphs in the same order on every rank.
    return said, pixels(generate(model, Request(PROMPT, steps=3, seed=1, cache_steps="0,2")).image)


@pytest.mark.slow
def test_runs_whose_cfg_groups_diverge_are_refused_on_every_rank_before_any_waits(tiny_ckpt):
    ranks = spawn(_rank, 2, str(tiny_ckpt), True, timeout=300)
    for said, _ in ranks:
        threshold, idle = said
        assert threshold and "step caching by threshold on a CFG-parallel bundle" in threshold, said
        assert idle and "idles CFG group 1" in idle, said
        assert "\n" not in threshold + idle
    assert np.array_equal(ranks[0][1], ranks[1][1])
    # The refusals are the lockstep device's alone: unmarked, the same ranks run both.
    unmarked = spawn(_rank, 2, str(tiny_ckpt), False, timeout=300)
    assert all(said == [None, None] for said, _ in unmarked)
    assert np.array_equal(unmarked[0][1], ranks[0][1])
