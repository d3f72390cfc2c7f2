"""Graceful interruption: SIGINT/SIGTERM ask the trainer to stop after the current step and save ``last``.

The handler only sets a flag, so a checkpoint being written is never cut in half by the signal itself
(checkpoints are also written into a temporary folder and renamed into place, so even SIGKILL cannot
corrupt one). A second SIGINT raises KeyboardInterrupt at once for the impatient.
"""
from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


class GracefulInterrupt:
    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning("received %s: finishing the current step, then saving the last checkpoint "
                       "(press Ctrl-C again to abort at once)", signal.Signals(signum).name)

    def __enter__(self) -> "GracefulInterrupt":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
