"""Optional progress bars: tqdm when it is installed and asked for, otherwise nothing at all."""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    """A 0..total bar on stderr; every method is a no-op when disabled or tqdm is missing."""

    def __init__(self, enabled: bool, total: float, desc: str, unit: str = "%") -> None:
        self._bar: Any = None
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} [{elapsed}<{remaining}{postfix}]",
        )

    @property
    def active(self) -> bool:
        return self._bar is not None

    def update_to(self, n: float | None, status: str | None = None) -> None:
        """Move the bar to `n` (never backwards) and show `status` beside it."""
        if self._bar is None:
            return
        if status is not None:  # first, so the redraw inside update() shows the new status
            self._bar.set_postfix_str(status, refresh=False)
        if n is not None and n > self._bar.n:
            self._bar.update(n - self._bar.n)
        self._bar.refresh()

    def set_total(self, total: float) -> None:
        if self._bar is not None and total and total != self._bar.total:
            self._bar.total = total
            self._bar.refresh()

    def write(self, text: str) -> None:
        """Print a line above the bar; plainly on stderr when tqdm is missing; nothing when disabled."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif self._enabled:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
