"""Stop signals for a regeneration run: SIGTERM (preemption), SIGINT (Ctrl-C), SIGHUP (a closed terminal).

While :class:`StopSignals` is entered, a stop signal does not kill the process: it records the
signal's name and calls the registered callbacks (the OpenAI driver cancels its requests in
flight, the HF backend stops ``generate`` at the next token), so that the run ends with its
summary, ``meta.json`` updated and exit status ``EXIT_STOPPED``. Only the main thread can own
signal handlers; elsewhere (a run inside a worker thread) nothing is installed.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from dflash.config import STOP_SIGNALS

log = logging.getLogger(__name__)


class StopSignals:
    """``with StopSignals() as stop: ... stop.signal`` (None, or the first stop signal's name)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (in the main thread, inside the signal handler) on a stop signal;
        returns the function that unregisters it."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            log.warning("%s received: already stopping after %s", name, self.signal)
            return
        self.signal = name
        log.warning("%s received: stopping (the records in flight are redone by the next run)", name)
        for callback in list(self._callbacks):
            callback()
