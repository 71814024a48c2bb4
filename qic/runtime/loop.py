"""The denoise loop: one for every path (a whole-step graph a step, step caching's split graphs; every layout).

In flux's manner the loop knows only the schedule and a step callable, so what a step is (which graphs it
calls, what step caching decides, which collectives a decision reads) is the caller's, and so is what is
done with each step's time. Each step graph applies the Euler update itself (the latents in are the latents
out, qic/models/qwen_image/step.py), so the loop carries x from one step to the next and adds nothing to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from qic.host.schedule import Schedule

# (i, latents, timestep, sigma, sigma_next) -> the next latents: one denoise step, Euler update included.
Step = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def denoise_loop(step: Step, x: torch.Tensor, schedule: Schedule,
                 on_step: Callable[[int, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> torch.Tensor:
    """Every step of `schedule` over latents x; returns the final latents. on_step(i, seconds): step i's time
    as `clock` measured it around the step call (what the caller records; nothing by default)."""
    for i, t in enumerate(schedule.timesteps):
        t0 = clock()
        x = step(i, x, t, schedule.sigmas[i], schedule.sigmas[i + 1])
        if on_step is not None:
            on_step(i, clock() - t0)
    return x


def record_steps(times: dict) -> Callable[[int, float], None]:
    """on_step for the runtime's timings: step i's seconds as times['step<i>']."""
    def on_step(i: int, seconds: float) -> None:
        times[f"step{i}"] = seconds
    return on_step
