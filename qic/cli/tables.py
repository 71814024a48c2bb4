"""What every verb's output shares: sizes in words, and consoles wide enough for graph names."""

from __future__ import annotations

from rich.console import Console


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def wide_console(stderr: bool = False) -> Console:
    """Tables keep their graph names whole when written to a file or pipe (rich assumes 80 columns there)."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)
