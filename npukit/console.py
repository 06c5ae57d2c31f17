"""One way to make the rich console npukit's commands print with."""

from __future__ import annotations

import os

from rich.console import Console

PIPED_WIDTH = 160


def make_console(*, stderr: bool = False, **options) -> Console:
    """A console that stays readable when piped or captured: rich would wrap tables at 80 columns
    there. COLUMNS, when set, still wins."""
    console = Console(stderr=stderr, **options)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(stderr=stderr, width=PIPED_WIDTH, **options)


def number_ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> "0-2, 4, 6-7" (sorted numbers, as ranks and steps are listed to people)."""
    parts, start = [], None
    for index, number in enumerate(numbers):
        if start is None:
            start = number
        if index + 1 == len(numbers) or numbers[index + 1] != number + 1:
            parts.append(str(start) if start == number else f"{start}-{number}")
            start = None
    return ", ".join(parts)
