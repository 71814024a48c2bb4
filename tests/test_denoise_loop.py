"""qic/runtime/loop.py: the one denoise loop feeds each step its schedule values in order, carries the latents
from step to step, and hands each step's time to the callback. No model: a step callable that records."""

from __future__ import annotations

import itertools

import torch

from qic.host.schedule import flow_match_schedule
from qic.runtime.loop import denoise_loop, record_steps


def test_the_loop_runs_every_step_of_the_schedule_in_order_and_times_each():
    schedule = flow_match_schedule({"shift": 3.0}, 4, 16)
    calls = []

    def euler(i, x, timestep, sigma, sigma_next):   # as the step graph's update with a prediction of ones
        calls.append((i, float(timestep), float(sigma), float(sigma_next)))
        return x + (sigma_next - sigma)

    ticks = itertools.count()                        # a clock that advances 1 s a reading
    times: dict = {}
    x = denoise_loop(euler, torch.zeros(2), schedule, record_steps(times), clock=lambda: float(next(ticks)))
    s, t = schedule.sigmas.tolist(), schedule.timesteps.tolist()
    assert calls == [(i, t[i], s[i], s[i + 1]) for i in range(4)]
    # The latents carried: the updates telescope to sigma_end - sigma_0 = -sigma_0 (the schedule ends in 0).
    assert torch.allclose(x, torch.full((2,), -s[0]))
    assert times == {f"step{i}": 1.0 for i in range(4)}
