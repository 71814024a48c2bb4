"""Flow-matching sigma schedule, computed exactly as diffusers' FlowMatchEulerDiscreteScheduler does.

The arithmetic (float32 numpy, then torch) follows diffusers step by step so that a qic image and a
diffusers image from the same seed agree bit for bit in the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from qic.errors import ConfigError

# Options that would change the schedule in ways qic does not implement; refused, not ignored.
_UNSUPPORTED_TRUE = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                     "stochastic_sampling")


@dataclass(frozen=True)
class Schedule:
    sigmas: torch.Tensor     # [steps + 1] float32, ends in 0
    timesteps: torch.Tensor  # [steps] float32, the scheduler's t = sigma * 1000 (the step graph divides by 1000)


# FlowMatchEulerDiscreteScheduler's config keys that a build config may override, with their types.
_NUMBER = (int, float)
OVERRIDABLE = {"num_train_timesteps": int, "shift": _NUMBER, "use_dynamic_shifting": bool, "base_shift": _NUMBER,
               "max_shift": _NUMBER, "base_image_seq_len": int, "max_image_seq_len": int,
               "shift_terminal": (*_NUMBER, type(None)), "time_shift_type": str, "invert_sigmas": bool,
               "use_karras_sigmas": bool, "use_exponential_sigmas": bool, "use_beta_sigmas": bool,
               "stochastic_sampling": bool}


def check_overrides(overrides: Mapping, source: str = "config") -> None:
    """A build config's `scheduler:` keys: known names, right types; the merged config is checked after."""
    for key, value in overrides.items():
        if key not in OVERRIDABLE:
            raise ConfigError(f"{source}: scheduler key {key!r} is not a FlowMatchEulerDiscreteScheduler option; "
                              f"allowed: {', '.join(OVERRIDABLE)}")
        kind = OVERRIDABLE[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"{source}: scheduler.{key} = {value!r} has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: scheduler.{key} must be finite, got {value!r}")
    terminal = overrides.get("shift_terminal")
    if terminal is not None and not 0 <= terminal < 1:
        raise ConfigError(f"{source}: scheduler.shift_terminal must be in [0, 1) or null, got {terminal!r}")
    for key in ("num_train_timesteps", "base_image_seq_len", "max_image_seq_len"):
        if key in overrides and overrides[key] <= 0:
            raise ConfigError(f"{source}: scheduler.{key} must be positive, got {overrides[key]!r}")


def merge_scheduler(checkpoint_config: Mapping, overrides: Mapping) -> dict:
    """The checkpoint's scheduler config with a build's overrides on top, checked as a whole."""
    merged = {**checkpoint_config, **overrides}
    check_scheduler_config(merged)
    if merged.get("use_dynamic_shifting") and merged.get("base_image_seq_len") == merged.get("max_image_seq_len"):
        raise ConfigError("scheduler: base_image_seq_len equals max_image_seq_len; the shift would divide by zero")
    return merged


def check_scheduler_config(config: Mapping) -> None:
    for key in _UNSUPPORTED_TRUE:
        if config.get(key):
            raise ConfigError(f"scheduler config sets {key}=true; qic implements the plain flow-match Euler "
                              "schedule only")
    shift_type = config.get("time_shift_type", "exponential")
    if shift_type not in ("exponential", "linear"):
        raise ConfigError(f"scheduler config has time_shift_type={shift_type!r}; expected 'exponential' or 'linear'")


def compute_mu(image_seq_len: int, config: Mapping) -> float:
    """Resolution-dependent shift: linear in the packed image sequence length (diffusers' calculate_shift)."""
    base_seq = config.get("base_image_seq_len", 256)
    max_seq = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_seq - base_seq)
    b = base_shift - m * base_seq
    return image_seq_len * m + b


def flow_match_schedule(config: Mapping, steps: int, image_seq_len: int) -> Schedule:
    """Sigmas and model timesteps for `steps` Euler steps at a packed image sequence length."""
    check_scheduler_config(config)
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if steps == 1 and config.get("shift_terminal"):
        # Stretching a one-point schedule to shift_terminal divides 0 by 0: diffusers yields NaN sigmas.
        raise ConfigError("steps must be >= 2 with this scheduler (shift_terminal is set)")
    return schedule_of(config, np.array(np.linspace(1.0, 1 / steps, steps)).astype(np.float32), image_seq_len)


def schedule_of(config: Mapping, sigmas: np.ndarray, image_seq_len: int) -> Schedule:
    """FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...) step by step (float32 numpy, then torch): the
    dynamic shift at mu(image_seq_len) or the static shift, the stretch to shift_terminal, the terminal 0."""
    check_scheduler_config(config)
    sigmas = np.asarray(sigmas, dtype=np.float32)
    if len(sigmas) == 1 and config.get("shift_terminal"):
        raise ConfigError("a one-step schedule cannot be stretched to shift_terminal (diffusers yields NaN)")
    if config.get("use_dynamic_shifting", False):
        mu = compute_mu(image_seq_len, config)
        if config.get("time_shift_type", "exponential") == "exponential":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        else:
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
    else:
        shift = config.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    terminal = config.get("shift_terminal")
    if terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - (one_minus / (one_minus[-1] / (1 - terminal)))
    sig = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    train_steps = config.get("num_train_timesteps", 1000)
    # diffusers keeps timesteps = sigma * 1000 and the pipeline passes timestep / 1000: the step graph
    # divides, so both roundings are kept.
    timesteps = sig * train_steps
    return Schedule(sigmas=torch.cat([sig, torch.zeros(1)]), timesteps=timesteps)
