"""Blocking work off the GUI thread. ``Bridge.run`` executes a function on a background thread and
calls back on the GUI thread; ``Bridge.post`` hands a callable from any thread to the GUI thread.
No Qt object is touched from a plain thread: results go through a queue the GUI thread drains."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from PySide6.QtCore import QObject, QTimer

logger = logging.getLogger(__name__)


class Bridge(QObject):
    def __init__(self, parent: QObject | None = None, *, workers: int = 3, period_ms: int = 50):
        super().__init__(parent)
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="app-bg")
        self._closed = False
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.drain)
        self._timer.start(period_ms)

    def post(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the GUI thread soon (safe from any thread)."""
        self._calls.put(call)

    def run(self, work: Callable[[], Any], done: Callable[[Any], None] | None = None,
            failed: Callable[[BaseException], None] | None = None) -> Future:
        """Run ``work`` on a background thread; then ``done(result)`` or ``failed(exc)`` on the GUI thread."""

        def finished(future: Future) -> None:
            exc = future.exception()
            if exc is not None:
                if failed is not None:
                    self.post(lambda: failed(exc))
                else:
                    logger.error("Background task failed", exc_info=exc)
            elif done is not None:
                result = future.result()
                self.post(lambda: done(result))

        if self._closed:  # the app is quitting: nothing new starts
            future: Future = Future()
            future.cancel()
            return future
        future = self._pool.submit(work)
        future.add_done_callback(finished)
        return future

    def drain(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                call()
            except Exception:  # one bad callback must not stop the app
                logger.exception("Callback on the GUI thread failed")

    def shutdown(self) -> None:
        self._closed = True
        self._timer.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
