"""The denoise loop: one for every path (a whole-step graph a step, step caching's split graphs; every layout).

In flux's manner the loop knows only the schedule and a step callable, so what a step is (which graphs it
calls, what step caching decides, which collectives a decision reads) is the caller's, and so is what is
done with each step's time. Each step graph applies the Euler update itself (the latents in are the latents
out, qic/models/qwen_image/step.py), so the loop carries x from one step to the next and adds nothing to it.

Previews (qic serve's streamed partial images) are the clean latents a step predicts, read from its Euler update:
x_next = x + (sigma_next - sigma) * v with the flow-matching velocity v = noise - x0 and x = (1 - sigma) x0 +
sigma * noise, so x0 = x - sigma * v = x - sigma * (x_next - x) / (sigma_next - sigma); after the last step (sigma_next
0) that is x_next itself, the final latents. It needs nothing from the step graphs beyond what every step returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from qic.host.schedule import Schedule

# (i, latents, timestep, sigma, sigma_next) -> the next latents: one denoise step, Euler update included.
Step = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# previews(i, steps, decode) after step i of `steps`: decode(wanted) gives the pictures the step predicts for the
# batch's images `wanted` (indices), as a list over the whole batch (None for an image not wanted or not held by this
# rank), decoded only if called.
Previews = Callable[[int, int, Callable[[list[int]], list]], None]


def denoise_loop(step: Step, x: torch.Tensor, schedule: Schedule,
                 on_step: Callable[[int, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 previews: Previews | None = None,
                 decode: Callable[[torch.Tensor, list[int]], list] | None = None) -> torch.Tensor:
    """Every step of `schedule` over latents x; returns the final latents. on_step(i, seconds): step i's time
    as `clock` measured it around the step call (what the caller records; nothing by default). previews: called
    after each step with the step's predicted clean latents decoded by `decode` ((latents, wanted) -> images, one
    per batch image, None where not wanted) on demand."""
    steps = len(schedule.timesteps)
    for i, t in enumerate(schedule.timesteps):
        t0 = clock()
        sigma, sigma_next = schedule.sigmas[i], schedule.sigmas[i + 1]
        x_next = step(i, x, t, sigma, sigma_next)
        if on_step is not None:
            on_step(i, clock() - t0)
        if previews is not None:
            previews(i, steps, lambda wanted, x=x, x_next=x_next, sigma=sigma, sigma_next=sigma_next:
                     decode(predicted_clean(x, x_next, sigma, sigma_next), wanted))
        x = x_next
    return x


def predicted_clean(x: torch.Tensor, x_next: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """The clean latents a flow-matching Euler step from x (at sigma) to x_next (at sigma_next) predicts, in fp32
    (the module docstring says why)."""
    x, x_next = x.float(), x_next.float()
    return x - sigma * (x_next - x) / (sigma_next - sigma)


def record_steps(times: dict) -> Callable[[int, float], None]:
    """on_step for the runtime's timings: step i's seconds as times['step<i>']."""
    def on_step(i: int, seconds: float) -> None:
        times[f"step{i}"] = seconds
    return on_step
