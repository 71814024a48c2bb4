"""The one error type users see: a readable line plus the fix, never a traceback; and warnings, one line each."""

import sys


class QicError(Exception):
    """An error the CLI prints as one line (and a hint), not a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class ConfigError(QicError):
    """A model config.json or a build config carries something qic cannot honour."""


class CheckpointError(QicError):
    """A checkpoint file, index or tensor is missing, truncated or inconsistent."""


class BundleError(QicError):
    """A bundle is missing, tampered with, or incompatible with this qic/torch."""


class CompileError(QicError):
    """A compiler (e.g. neuronx-cc) refused a graph; the message carries its log's tail."""


def warn(message: str) -> None:
    """One line on stderr that a user should read but that stops nothing."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
