"""The driver's command channel with a deadline: broadcasts that give up on a rank that stopped taking them.

The commands go over the gloo group that has no practical timeout (distributed/group.py: a worker may wait
for its next command indefinitely). The sending side must not wait that long: a worker stopped (SIGSTOP,
a hung host) while it waits for its next command leaves rank 0's broadcast blocked in gloo for good, and
the step's own collectives, which do time out, are never reached. `CommandSender.send` therefore runs the
broadcast on a daemon thread of its own and waits for it at most the given time; past that it raises
TimeoutError and the caller treats the group as failed (no further command is sent: the blocked thread
ends when the workers are killed and gloo's connections close).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol


class _Broadcaster(Protocol):
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any: ...


class CommandSender:
    """Rank 0's `broadcast_object` of commands on a thread of its own, one at a time.

    Args:
        group: the tensor-parallel group (`TPGroup`), whose `broadcast_object` sends a command.
    """

    def __init__(self, group: _Broadcaster) -> None:
        self._group = group
        self._queue: queue.SimpleQueue[tuple[Any, Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="tinyvllm-tp-commands", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            message, future = item
            try:
                future.set_result(self._group.broadcast_object(message))
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)

    def send(self, message: Any, timeout_s: float | None) -> None:
        """Broadcast `message` to every rank, waiting at most `timeout_s` (None: as long as it takes) before
        raising TimeoutError; the broadcast's own error is raised as is."""
        future: Future = Future()
        self._queue.put((message, future))
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"the ranks did not take a command within {timeout_s:g} s (timed out)") from None

    def close(self, wait_s: float = 0.0) -> bool:
        """End the sending thread once it is free, waiting up to `wait_s` for it (a broadcast still blocked
        ends when gloo's connections close). Returns whether the thread has ended."""
        self._queue.put(None)
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()
