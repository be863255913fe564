"""MPAsyncLLMEngine: the EngineCore loop in a process of its own (vLLM v1's design).

The API process keeps the asyncio app (this module and the app import no torch, and nothing there
initialises CUDA); the engine process builds the LLMEngine from the EngineArgs (CUDA is initialised
there only: the process is spawned, not forked) and runs `EngineCore.run`. Two one-way pipes connect
them (multiprocessing.connection):

    API process                                        engine process
    event loop --commands--> sender thread  ==pipe==>  EngineCore: apply commands, step,
    event loop <--call_soon_threadsafe-- reader thread  <==pipe==  send one EngineCoreOutputs per step

The sender thread batches the commands queued since its last write into one pickled message, so the
event loop never blocks on a pipe. The engine process answers the start with a pickled EngineReady
(or EngineFailed); after that each of its messages is an EngineCoreOutputs or EngineDead in msgpack
(`tinyvllm.engine.messages`: the per-step outputs are the hot path). The reader thread decodes each
message, runs the output processing of its outputs (the core sends token ids; text and stop strings
are done here, and a stop string sends the core an abort) and dispatches them to the streams
(`EngineClient._handle`), while the core runs its next step.

Failures: an exception in the engine loop is sent as EngineDead before the process exits
with status 1; a process that vanishes (killed, crashed) closes its pipe. Either way the reader thread
marks the engine dead. A process that hangs (alive, but stuck in a step: a collective that never
completes, a device that stopped answering) is caught by a deadline: while requests are in flight the
core sends a message after every step, so when none comes for `step_timeout_s` seconds the reader
thread kills the process and marks the engine dead the same way. The engine process ignores SIGINT
(a Ctrl-C in the terminal reaches the whole process group; the API process drains in-flight requests,
then stops the engine) and exits when its command pipe closes, so it never outlives the API process.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tinyvllm.engine.async_llm import EngineClient, EngineDeadError, EngineInfo
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.messages import (
    EngineCommand,
    EngineCoreOutputs,
    EngineDead,
    EngineFailed,
    EngineReady,
    Shutdown,
    encoder,
    output_decoder,
)

logger = logging.getLogger(__name__)

EngineFactory = Callable[[Any], Any]  # EngineArgs -> LLMEngine, run in the engine process; must pickle
DEFAULT_STEP_TIMEOUT_S = 120.0  # longer than any step, Triton compiling a new shape included
_POLL_S = 1.0  # how often the reader thread checks the deadline while the core is quiet


class EngineStartError(RuntimeError):
    """The engine process could not build the engine (the message says why)."""


class MPAsyncLLMEngine(EngineClient):
    """An EngineClient whose core runs in a spawned process. See the module docstring.

    Args:
        engine_args: tinyvllm.engine.args.EngineArgs for the engine process.
        max_waiting_requests: reject (QueueFullError) while this many requests wait; None: no limit.
        engine_factory: builds the engine in the engine process (default: LLMEngine(engine_args));
            a picklable callable, for tests that need a fake or failing engine.
        show_progress: show the model-loading progress bar.
        step_timeout_s: with requests in flight, a core that sends nothing for this long is hung: it
            is killed and the engine is dead. None: no deadline.
        name: names the engine in its errors and its process ("data-parallel core 1 of 2").
        env: environment variables the engine process sets before it builds the engine (which GPUs
            it sees: CUDA_VISIBLE_DEVICES).
        num_threads: torch's CPU threads in the engine process (default: one fewer than the cores).
    """

    def __init__(
        self,
        engine_args: Any,
        max_waiting_requests: int | None = None,
        engine_factory: EngineFactory | None = None,
        show_progress: bool = False,
        step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
        name: str | None = None,
        env: dict[str, str] | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(max_waiting_requests)
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive (or None: no deadline), got {step_timeout_s}")
        self.engine_args = engine_args
        self.step_timeout_s = step_timeout_s
        self.name = name
        self._env = dict(env or {})
        self._num_threads = num_threads
        self._factory = engine_factory
        self._show_progress = show_progress
        self._hung_after: float | None = None  # set when the deadline killed the process
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._to_core: Connection | None = None
        self._from_core: Connection | None = None
        self._stopping = False
        # One thread at a time may wait for the process: two concurrent waitpid() calls on one pid
        # let the loser see ECHILD, and multiprocessing then reports a reaped process as alive.
        self._wait_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="tinyvllm-engine-reader", daemon=True)
        self._sender = threading.Thread(target=self._write, name="tinyvllm-engine-sender", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        with self._wait_lock:
            return self._proc is not None and self._proc.is_alive()

    def start(self, timeout: float | None = None) -> MPAsyncLLMEngine:
        """Spawn the engine process and wait until its engine is built (`timeout` seconds at most).

        Raises:
            EngineStartError: the engine could not be built, or the process died while building it.
        """
        self.launch()
        return self.wait_until_ready(timeout)

    def launch(self) -> None:
        """Spawn the engine process (the first half of `start`: several engines build at once when
        each is launched before any is waited for)."""
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_engine_process,
            name="tinyvllm-engine-core" if self.name is None else f"tinyvllm-{self.name.replace(' ', '-')}",
            daemon=True,
            args=(
                self.engine_args,
                self.max_waiting_requests,
                self._factory,
                self._show_progress,
                logging.getLogger().level,
                cmd_recv,
                out_send,
                self._env,
                self._num_threads,
            ),
        )
        _grow_pipe(out_recv)
        proc.start()
        self._proc = proc  # only once started: shutdown() waits for a started process
        cmd_recv.close()  # the child's ends: closing ours lets each side see the other's death as EOF
        out_send.close()
        self._to_core, self._from_core = cmd_send, out_recv

    def wait_until_ready(self, timeout: float | None = None) -> MPAsyncLLMEngine:
        """Wait until the launched engine process has built its engine (`timeout` seconds at most),
        then start the reader and sender threads (the second half of `start`).

        Raises:
            EngineStartError: as `start`.
        """
        try:
            ready = self._wait_until_ready(timeout)
            from tinyvllm.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(ready.tokenizer)
            if ready.chat_template is not None:  # the engine's `chat_template` option
                tokenizer.chat_template = ready.chat_template
        except BaseException:
            self._kill()
            raise
        self.info = EngineInfo(
            tokenizer,
            ready.vocab_size,
            ready.max_model_len,
            ready.default_sampling_params,
            ready.model_dir,
            ready.default_max_tokens,
            ready.max_tokens_cap,
        )
        self.stats = ready.stats
        self._reader.start()
        self._sender.start()
        return self

    def _wait_until_ready(self, timeout: float | None) -> EngineReady:
        assert self._from_core is not None and self._proc is not None
        try:
            if not self._from_core.poll(timeout):
                raise EngineStartError(f"the engine process did not start within {timeout} s")
            message = self._from_core.recv()
        except (EOFError, OSError):
            raise EngineStartError(f"the engine process died while starting ({_exit(self._wait(5))})") from None
        if isinstance(message, EngineFailed):
            raise EngineStartError(message.message)
        return message

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine process (what is in flight fails with EngineDeadError), wait for it and for
        the reader; kill it if it does not stop within `timeout` seconds."""
        if self._proc is None:
            return
        self._stopping = True
        self._commands.put(Shutdown())
        if self._wait(timeout) is None:
            logger.warning("the engine process did not stop within %s s; killing it", timeout)
            self._kill()
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._die(RuntimeError("the engine was shut down"))
        if self._sender.is_alive():
            self._sender.join(timeout)
        for conn in (self._to_core, self._from_core):
            if conn is not None:
                conn.close()

    def _wait(self, timeout: float | None) -> int | None:
        """Wait up to `timeout` seconds for the engine process to exit; its exit code, None if it runs."""
        assert self._proc is not None
        with self._wait_lock:
            self._proc.join(timeout)
            return self._proc.exitcode

    def _kill(self) -> None:
        if self._proc is not None and self.is_running:
            self._proc.kill()
            self._wait(10)

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)

    def _dead(self) -> EngineDeadError:
        if self.name is None:
            return super()._dead()
        return EngineDeadError(f"the engine is not running ({self.name}: {self.dead_error})")

    # ------------------------------------------------------------------ the two threads
    def _write(self) -> None:
        """Sender thread: one pipe message per batch of queued commands, until Shutdown."""
        assert self._to_core is not None
        while True:
            batch = [self._commands.get()]
            while True:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                self._to_core.send(batch)
            except (OSError, ValueError):  # the engine process is gone: the reader reports it
                return
            except BaseException as e:
                logger.exception("could not send commands to the engine process")
                self._die(e)
                self._kill()
                return
            if any(isinstance(c, Shutdown) for c in batch):
                return

    def _read(self) -> None:
        """Reader thread: dispatch the engine process's messages until it stops or dies."""
        assert self._from_core is not None and self._proc is not None
        error: BaseException | None = None
        conn = self._from_core
        decode = output_decoder.decode
        heard = time.monotonic()  # when the core last sent something, or last had nothing to do
        try:
            while True:
                if not conn.poll(_POLL_S):
                    heard = self._check_deadline(heard)
                    continue
                heard = time.monotonic()
                message = decode(conn.recv_bytes())
                if isinstance(message, EngineDead):
                    error = RuntimeError(message.message)
                    break
                self._handle(message)
        except (EOFError, OSError):
            pass
        except BaseException as e:
            logger.exception("the engine reader thread failed")
            error = e
            self._kill()  # nobody reads its outputs any more
        if error is None:
            if self._hung_after is not None:
                error = RuntimeError(
                    f"the engine process sent nothing for {self._hung_after:.0f} s with requests in flight "
                    f"(hung; the deadline is {self.step_timeout_s:g} s); it was killed"
                )
            elif self._stopping:
                error = RuntimeError("the engine was shut down")
            else:
                error = RuntimeError(f"the engine process died unexpectedly ({_exit(self._wait(5))})")
        if not self._stopping:
            logger.error("engine dead: %s", error)
        self._die(error)

    def _check_deadline(self, heard: float) -> float:
        """On the reader thread while the core is quiet: kill a core that owes an answer (requests in
        flight) and has sent nothing for `step_timeout_s`; returns the new `heard` time (now, while
        nothing is in flight: an idle core owes nothing)."""
        now = time.monotonic()
        if not self.num_in_flight or self._stopping:
            return now
        if self.step_timeout_s is not None and now - heard > self.step_timeout_s and self._hung_after is None:
            self._hung_after = now - heard
            logger.error(
                "%s sent nothing for %.0f s with %d request(s) in flight; killing it",
                self.name or "the engine process",
                self._hung_after,
                self.num_in_flight,
            )
            self._kill()  # its pipe closes: the loop ends on EOF and reports the hang
        return heard


def _grow_pipe(conn: Connection, size: int = 1 << 20) -> None:
    """Let the output pipe buffer ~1 MiB (Linux; default 64 KiB, a few steps at batch 256), so that
    the engine process does not wait on a reader that is late by a step or two."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
    except (ImportError, AttributeError, OSError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: keep the default


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


# ---------------------------------------------------------------------- the engine process
def _build_engine(engine_args: Any, show_progress: bool = False) -> Any:
    from tinyvllm.gc_pause import gc_paused

    with gc_paused(freeze=True):  # loads torch: long-lived objects only (gc_pause.py)
        from tinyvllm.engine.llm_engine import LLMEngine

    return LLMEngine(engine_args, show_progress=show_progress)


def _leave_a_core_to_the_server(num_threads: int | None = None) -> None:
    """torch's CPU thread pool defaults to one thread per core, and its idle threads spin: with the
    API process wanting a core too, steps on a small machine slowed down up to 30x (2 cores, CPU
    device). Unless OMP_NUM_THREADS says otherwise, use one thread fewer than the cores we may use
    (or `num_threads`, where the caller shares the cores among several engines)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
        return

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores - 1)))


def run_engine_process(
    engine_args: Any,
    max_waiting_requests: int | None,
    factory: EngineFactory | None,
    show_progress: bool,
    log_level: int,
    commands: Connection,
    out: Connection,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
) -> None:
    """Main of the engine process: set `env`, build the engine, report EngineReady, run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when the engine stops
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    os.environ.update(env or {})  # before anything initialises CUDA (CUDA_VISIBLE_DEVICES is read then)
    try:
        _leave_a_core_to_the_server(num_threads)
        engine = factory(engine_args) if factory is not None else _build_engine(engine_args, show_progress)
    except BaseException as e:
        logger.exception("could not build the engine")
        out.send(EngineFailed(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    info = EngineInfo.of(engine)
    out.send(
        EngineReady(
            str(getattr(engine_args, "tokenizer", None) or info.model_dir),
            info.vocab_size,
            info.max_model_len,
            info.default_sampling_params,
            info.model_dir,
            dict(engine.get_metrics()),
            info.tokenizer.chat_template if getattr(engine_args, "chat_template", None) is not None else None,
            info.default_max_tokens,
            info.max_tokens_cap,
        )
    )
    core = EngineCore(engine, max_waiting_requests)

    def recv(block: bool) -> list[EngineCommand] | None:
        try:
            if not block and not commands.poll():
                return []
            batch = commands.recv()
            while commands.poll():
                batch += commands.recv()
            return batch
        except (EOFError, OSError):
            return None  # the API process is gone

    def emit(message: EngineCoreOutputs) -> None:
        out.send_bytes(encoder.encode(message))

    try:
        core.run(recv, emit)
    except BaseException as e:
        logger.exception("engine loop died")
        with contextlib.suppress(OSError, ValueError):  # the API process is gone
            out.send_bytes(encoder.encode(EngineDead(f"{type(e).__name__}: {e}")))
        sys.exit(1)
