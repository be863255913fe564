"""CommandSender (distributed/commands.py): a broadcast that does not complete in time raises TimeoutError
instead of blocking its caller; a completed one returns, and its errors reach the caller."""

from __future__ import annotations

import threading
import time

import pytest

from tinyvllm.distributed.commands import CommandSender


class FakeGroup:
    """broadcast_object records the message; with `block` set it waits for `release` first (a rank that
    stopped taking commands); `fail` makes it raise."""

    def __init__(self) -> None:
        self.sent: list = []
        self.block = False
        self.release = threading.Event()
        self.fail: Exception | None = None

    def broadcast_object(self, obj=None, src: int = 0):
        if self.block:
            self.release.wait()
        if self.fail is not None:
            raise self.fail
        self.sent.append(obj)
        return obj


def test_commands_arrive_in_order():
    group = FakeGroup()
    sender = CommandSender(group)
    for i in range(5):
        sender.send(("launch", i), 1.0)
    sender.send(("call", "x"), None)
    assert group.sent == [("launch", i) for i in range(5)] + [("call", "x")]
    sender.close()


def test_a_blocked_broadcast_times_out_within_its_deadline():
    group = FakeGroup()
    group.block = True
    sender = CommandSender(group)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        sender.send(("launch", 0), 0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    group.release.set()  # the stuck broadcast ends (gloo's connection closed): the thread goes on
    sender.close()


def test_the_broadcasts_own_error_reaches_the_caller():
    group = FakeGroup()
    group.fail = RuntimeError("Connection closed by peer")
    sender = CommandSender(group)
    with pytest.raises(RuntimeError, match="Connection closed"):
        sender.send(("launch", 0), 1.0)
    sender.close()


def test_close_waits_for_a_blocked_broadcast_to_end():
    group = FakeGroup()
    group.block = True
    sender = CommandSender(group)
    with pytest.raises(TimeoutError):
        sender.send(("launch", 0), 0.1)
    assert not sender.close(wait_s=0.1)  # still blocked
    group.release.set()
    assert sender.close(wait_s=2.0)
