"""Server settings, kept apart from the app so that `qic serve` checks flags before importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    queue: int = 16          # images waiting beyond the batch running; more get 429
    timeout: float = 300.0   # seconds from arrival to the image, queueing included; 504 after
    max_n: int = 4           # images per request
    max_batch: int = 8       # largest batch of compatible images run together (if the bundle has the graphs)
