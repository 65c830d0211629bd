"""A logger wrapper for floods: one line per reason per interval."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Logs a message at most once per ``interval_s`` for each reason, saying how many
    were suppressed: a flood of bad records must not become a flood of log lines."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, reason: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        quiet = self._quiet.pop(reason, 0)
        self._last[reason] = now
        suffix = f" ({quiet} more since the last such message)" if quiet else ""
        self._log.warning(msg + suffix, *args, exc_info=exc_info)
