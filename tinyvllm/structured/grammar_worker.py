"""The grammar worker process: one `GrammarShard` served over a connection (structured/workers.py starts it).

    python -m tinyvllm.structured.grammar_worker FD

FD is the worker's end of a `multiprocessing.Pipe`, inherited from the engine's process. Messages are
tuples, the operation first; only `init`, `step` and `rollback` are answered, in order:

* ``("init", tokenizer_info_json)`` → ``("ready",)``
* ``("buffer", name, rows, width)``: attach the engine's shared-memory mask buffer `name`
* ``("grammar", key, compiled_json)``, ``("add", sid, key, accepted)``, ``("remove", sid)``
* ``("step", buffer_name | None, accept_ids, tokens, fill_ids, rows)`` → ``(rejected, terminated)`` when
  `accept_ids` is not empty, sent as soon as they are accepted, then ``dead`` when `fill_ids` is not
  empty, once the rows are filled (`GrammarShard.accept`, `GrammarShard.fill`): the engine reads the
  first while the worker fills
* ``("rollback", sid, num_tokens)`` → whether the grammar is complete after it

A sequence is named by the integer id (sid) the engine gave it when it placed it on this worker.
* ``("stop",)``, or the connection closing: exit.

An operation that fails answers ``("error", text)`` in place of its reply; one that has no reply reports
its failure in place of the next reply, so no error is lost.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


def _attach(name: str, rows: int, width: int) -> tuple[Any, Any]:
    """The shared-memory segment `name` as an int32 array [rows, width] (and the segment, kept open).
    The engine's process owns the segment: this process does not register it for clean-up."""
    from multiprocessing import resource_tracker, shared_memory

    import numpy as np

    segment = shared_memory.SharedMemory(name=name)
    with contextlib.suppress(Exception):  # a tracker that never registered it
        resource_tracker.unregister(segment._name, "shared_memory")  # the owner unlinks it, not us
    return np.ndarray((rows, width), dtype=np.int32, buffer=segment.buf), segment


def serve(conn: Connection) -> None:
    """Answer messages (module docstring) until `stop` or the connection closes."""
    import xgrammar as xgr

    from tinyvllm.structured.shard import GrammarShard

    op, info_json = conn.recv()
    assert op == "init", op
    shard = GrammarShard(xgr.TokenizerInfo.deserialize_json(info_json))
    conn.send(("ready",))
    buffers: dict[str, tuple[Any, Any]] = {}
    failure: str | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "stop":
            return
        if op == "step":
            failure = _step(conn, shard, buffers, message, failure)
            continue
        try:
            reply = None
            if op == "rollback":
                reply = shard.rollback(message[1], message[2])
            elif op == "buffer":
                buffers[message[1]] = _attach(*message[1:])
            elif op == "grammar":
                shard.add_grammar(message[1], message[2])
            elif op == "add":
                shard.add(message[1], message[2], message[3])
            elif op == "remove":
                shard.remove(message[1])
            else:
                raise ValueError(f"unknown operation {op!r}")
        except Exception:
            failure = failure or traceback.format_exc()
        if op == "rollback":
            reply, failure = (reply, None) if failure is None else (("error", failure), None)
            conn.send(reply)


def _step(conn: Connection, shard: Any, buffers: dict, message: tuple, failure: str | None) -> str | None:
    """One step: the accept answer, then the fill answer (each only when asked for); a failure is sent
    in place of every answer still due. Returns the failure still to report (None once sent)."""
    _, name, accept_ids, tokens, fill_ids, rows = message
    skip: list = []
    if accept_ids:
        if failure is None:
            try:
                rejected, skip = shard.accept(accept_ids, tokens)
            except Exception:
                failure = traceback.format_exc()
        conn.send(("error", failure) if failure is not None else (rejected, skip))
    if fill_ids:
        if failure is None:
            try:
                dead = shard.fill(fill_ids, rows, buffers[name][0], skip)
            except Exception:
                failure = traceback.format_exc()
        conn.send(("error", failure) if failure is not None else dead)
    return None if (accept_ids or fill_ids) else failure


def main() -> None:
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
