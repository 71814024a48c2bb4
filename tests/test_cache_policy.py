"""Step caching's per-row decision (qic.host.cache_policy.RowState.decide), without a model: cheap, so the
settings and figures are drawn (hypothesis) and every decision is held to the rules the module docstring states,
written here as properties of the decided sequence, not as a second copy of decide's code. Together they fix
each step's decision (by induction over the steps), so a decide that breaks any rule fails one of them.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from qic.host.cache_policy import CacheSettings, RowState

LIMIT = st.integers(-1, 5)                    # -1: no limit
FIGURE = st.one_of(st.floats(0, 3, allow_nan=False), st.just(math.nan))


def _decide(s: CacheSettings, figures: list[float]) -> list[bool]:
    row = RowState()
    decisions = [row.decide(s, step, diff) for step, diff in enumerate(figures)]
    assert row.computed == [i for i, c in enumerate(decisions) if c]
    assert row.cached_total == decisions.count(False)
    assert row.figures == [None if not any(decisions[:i]) else f for i, f in enumerate(figures)]
    return decisions


@settings(max_examples=400, deadline=None)
@given(threshold=st.floats(0.01, 2), warmup=st.integers(0, 4), max_cached=LIMIT, max_continuous=LIMIT,
       figures=st.lists(FIGURE, min_size=1, max_size=16))
def test_every_decision_follows_the_rules(threshold, warmup, max_cached, max_continuous, figures):
    s = CacheSettings(threshold=threshold, warmup=warmup, max_cached=max_cached, max_continuous=max_continuous)
    decisions = _decide(s, figures)
    assert decisions[0]                                          # nothing to compare with at a row's first step
    cached_total = cached_run = 0
    for step, (compute, diff) in enumerate(zip(decisions, figures)):
        limited = 0 <= max_cached <= cached_total or 0 <= max_continuous <= cached_run
        if step < warmup or step == 0:
            assert compute, step
        elif not compute:
            assert diff <= threshold and not limited, (step, diff)   # cached only under the threshold, within limits
        else:
            assert not diff <= threshold or limited, (step, diff)   # computed: over it (NaN is), or a limit reached
        cached_total, cached_run = (cached_total, 0) if compute else (cached_total + 1, cached_run + 1)
    assert max_cached < 0 or cached_total <= max_cached
    runs = "".join("c" if c else "s" for c in decisions).split("c")
    assert max_continuous < 0 or max(map(len, runs)) <= max_continuous


@settings(max_examples=200, deadline=None)
@given(mask=st.sets(st.integers(0, 15), min_size=1), figures=st.lists(FIGURE, min_size=1, max_size=16))
def test_a_static_mask_computes_its_steps_and_ignores_figures(mask, figures):
    decisions = _decide(CacheSettings(steps=tuple(sorted(mask))), figures)
    # Exactly the mask's steps, and the first step whatever the mask says (nothing cached before a compute).
    assert [i for i, c in enumerate(decisions) if c] == sorted({0} | mask & set(range(len(figures))))


def test_the_limits_change_what_is_computed():
    """Figures always under the threshold: without limits only the first step computes; each limit, and warmup,
    brings back the steps it names."""
    def computed(**kw):
        decisions = _decide(CacheSettings(threshold=1.0, **kw), [0.5] * 10)
        return [i for i, c in enumerate(decisions) if c]
    assert computed() == [0]
    assert computed(max_continuous=2) == [0, 3, 6, 9]
    assert computed(max_continuous=0) == list(range(10))
    assert computed(max_cached=3) == [0, 4, 5, 6, 7, 8, 9]
    assert computed(max_cached=0) == list(range(10))
    assert computed(warmup=3, max_continuous=1) == [0, 1, 2, 4, 6, 8]
    assert computed(max_cached=4, max_continuous=1) == [0, 2, 4, 6, 8, 9]
