"""Whether torchft's Lighthouse still answers while a replica group waits for a quorum (docs/fault-tolerance.md,
"When the Lighthouse is lost").

torchft's quorum waits for the Lighthouse up to its quorum timeout (--dist-timeout: 30 minutes by default) and
says nothing meanwhile: a Lighthouse that died left every group asleep. A watcher thread, armed while a quorum is
waited for (`waiting`) and idle otherwise, so a quorum that comes in milliseconds costs a step nothing, tries the
Lighthouse's port once a second once the wait is a second old; when it has not answered for LOST_SECONDS,
`on_lost` gets what the wait was for and why (multigpu/engine/replicas.py ends the run with one line). A quorum
that fails before that (a shorter --dist-timeout) is told apart the same way (`unreachable`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Callable
from urllib.parse import urlsplit

CHECK_SECONDS = 1.0  # between two tries of the Lighthouse's port, and each try's connection timeout
LOST_SECONDS = 3.0  # the Lighthouse unreachable this long, while a quorum is waited for: lost


class LighthouseWatch:
    """The Lighthouse at `address` (http://HOST:PORT), watched while a quorum is waited for; `on_lost(what,
    why)` is called once, from the watcher's thread, when it stopped answering meanwhile."""

    def __init__(self, address: str, on_lost: Callable[[str, str], None]):
        self.address = address
        self.on_lost = on_lost
        self._waiting: tuple[str, float] | None = None  # what is waited for, since when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="multigpu-lighthouse-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """A block that waits for the Lighthouse (a quorum): `what` names it in the line."""
        self._waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self._waiting = None

    def unreachable(self) -> str | None:
        """Why the Lighthouse does not accept a connection now (within CHECK_SECONDS), or None when it does."""
        parts = urlsplit(self.address if "://" in self.address else f"http://{self.address}")
        try:
            socket.create_connection((parts.hostname or "", parts.port or 80), timeout=CHECK_SECONDS).close()
        except OSError as error:
            if isinstance(error, TimeoutError):
                return f"no answer within {CHECK_SECONDS:g} s"
            return error.strerror or str(error)
        except ValueError:  # not an address with a port: torchft would have refused it at the start
            return None
        return None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(CHECK_SECONDS):
            waiting = self._waiting
            if waiting is None or time.monotonic() - waiting[1] < CHECK_SECONDS:
                failing_since = None
                continue
            why = self.unreachable()
            if why is None:
                failing_since = None
                continue
            failing_since = failing_since if failing_since is not None else time.monotonic()
            if time.monotonic() - failing_since >= LOST_SECONDS and self._waiting is waiting:
                self.on_lost(waiting[0], why)
                return
