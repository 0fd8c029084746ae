"""Serving one engine to many concurrent callers: `AsyncEngine` owns an `Engine` on one thread (the only thread
that touches it) and runs the continuous-batching loop there: requests join between steps, each request's new
tokens flow back through its own asyncio queue, finished and aborted ones leave. The adaptive policy sees the
live batch every step. The Serve deployment (serving/ray_app.py) wraps it; nothing here knows Ray."""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from flexdraft.core import logs
from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.engine import Engine
from flexdraft.engine.stats import RequestDelta, SpecDecodingStats, StepOutput, StepStats
from flexdraft.speculative.sampling import Generation, SamplingParams, TokenLogprob


class EngineFailed(RuntimeError):
    """The engine failed while decoding this request (it ends with this error; the other requests go on)."""


class EngineUnavailable(EngineFailed):
    """The engine is not taking requests: shut down, replaced by a reconfigure, or its loop died. Retry later."""


@dataclass(frozen=True)
class Chunk:
    """One item of a request's stream: the engine's delta of a step, as the step returned it, and on the last one
    the finished generation."""
    delta: RequestDelta
    finished: Generation | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.delta.tokens

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        return self.delta.logprobs


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: int | None = None  # set by the engine thread once the request is in the engine
    sent: int = 0  # tokens handed to the caller


class _LoopKilled(BaseException):
    """Test-only fault: escapes the loop's supervision, as a bug in the loop itself would."""


# after a failed step, a re-admitted request decodes this many steps alone before the next one joins
PROBATION_STEPS = 2
MAX_STRIKES = 3  # a request in this many failed steps without being singled out is ended (no endless retries)
# ... and this many failed steps in a row that held no request to charge end the loop: the engine itself is broken
# (the replica turns unhealthy and Serve replaces it), not one request


class EngineBroken(RuntimeError):
    """Steps keep failing with no request to blame: the loop ends (`AsyncEngine.death`)."""


T = TypeVar("T")
TRIM_EVERY_S = 10.0  # the engine thread hands the C heap's free pages back this often, between steps (~2-5 ms)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing): steps free many large
    tensors of varied shapes, and glibc keeps what they held, so a replica's RSS kept growing after warm-up."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def built_apart(build: Callable[[], T]) -> T:
    """build() on a thread of its own that ends with it -> what it returned; this thread then takes the OpenMP thread
    count build left (what AsyncEngine's thread copies). Build an engine this way before handing it to AsyncEngine:
    OpenMP keeps a pool of workers for every thread that has run a parallel region, and while a second pool lives
    beside the engine thread's, libgomp throttles its workers' spin-waiting, so each of a step's parallel regions
    wakes a sleeping worker (a 16-row decode ran at 0.65x the tok/s of the same engine on the thread that built it)."""
    def run() -> tuple[T, int]:
        return build(), torch.get_num_threads()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexdraft-build") as pool:
        built, threads = pool.submit(run).result()  # (the pool's thread ends on leaving: its OpenMP pool with it)
    torch.set_num_threads(threads)
    return built


class AsyncEngine:
    """`async for chunk in engine.generate(prompt_ids, params)`: the request's tokens as the engine makes them.
    A caller that stops iterating or is cancelled at any await (a client gone before admission, mid-stream or
    mid-step) aborts its request: its row and stream are freed at the next step. `on_step(step_output)` runs
    on the engine thread after every step (metrics).

    The loop is supervised: an exception in a command, a callback or a step never ends it. A failed step's
    requests go back to the queue with the tokens they made (`Engine.recover`) and rejoin one at a time, each
    decoding `PROBATION_STEPS` steps before the next joins, so a request that fails again alone is the one
    charged with the error while the others' outputs stay what they would have been. If the loop still ends
    (a bug), `alive` turns False, every waiting caller gets EngineUnavailable at once and so do new ones.
    Its torch work runs on its own thread: build the engine with `built_apart`, so that no other thread keeps an
    OpenMP pool beside it."""

    def __init__(self, engine: Engine, on_step: Callable[[StepOutput], None] | None = None):
        self.engine, self.on_step = engine, on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # orders `_send` against the loop's death: no command is left unanswered
        self._streams: dict[int, _Stream] = {}
        self._stopped = False
        self._closed = False  # the loop has ended: `_send` answers commands itself
        self._draining = False  # no new requests; the running ones finish (a reconfigure replaced this engine)
        self.death: str | None = None  # why the loop ended, when it ended other than by shutdown
        self.aborted = 0  # requests aborted because their caller went away
        self.failed_steps = 0  # steps that raised (each recovered)
        self.charged = 0  # requests ended with an error by a failed step
        self.most_rows = 0  # the largest batch a step has decoded
        self._stats = SpecDecodingStats()  # since start, over engines replaced by reconfigures (`stats()`)
        self._stats_lock = threading.Lock()
        self._strikes: dict[int, int] = {}  # request id -> failed steps it was in
        self._suspects: list[int] = []  # failed step's requests not yet re-admitted, in queue order
        self._probation: list = []  # [request id, steps left] of the request decoding alone after a failure
        self._admit_limit: int | None = None  # admissions per step (1 while isolating a failure, 0 on probation)
        self._futile = 0  # failed steps in a row that held no request (see EngineBroken)
        self._running: tuple[int, ...] = ()  # the requests in rows and those waiting, as the last step left them
        self._waiting: tuple[int, ...] = ()
        self._torch_threads = torch.get_num_threads()  # what the model was loaded for (RuntimeConfig.threads)
        self._thread = threading.Thread(target=self._run, name="flexdraft-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (any thread / event loop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.death is None

    async def generate(self, prompt_ids: list[int], params: SamplingParams, group=None) -> AsyncIterator[Chunk]:
        """Raises FlexDraftError (before any token) for a request the engine refuses, EngineFailed if the engine
        fails while decoding it, EngineUnavailable if it takes no requests. group: its client (`Engine.add_request`:
        clients share the batch's rows fairly)."""
        if self._draining or self._stopped or not self.alive:
            raise EngineUnavailable(self._unavailable())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        done = False
        try:
            self._send(("add", list(prompt_ids), params, group, stream, ticket))
            await asyncio.wrap_future(ticket)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished is not None
                yield item
                if done:
                    return
        finally:
            if not done:  # refused, cancelled, or the caller stopped early: free whatever the request holds
                ticket.cancel()
                self._send(("abort", stream), quiet=True)

    def load(self) -> dict:
        """Rows decoding, requests waiting, open streams and failure counts (read without locking: a snapshot
        for metrics and health)."""
        return {"alive": self.alive, "max_batch": self.engine.config.max_batch, "running": len(self._running),
                "waiting": len(self._waiting),
                "streams": len(self._streams), "steps": self._stats.num_steps, "most_rows": self.most_rows,
                "aborted": self.aborted, "failed_steps": self.failed_steps, "failed_requests": self.charged}

    def call(self, fn: Callable[[Engine], object], timeout: float | None = 60.0) -> object:
        """Run fn(engine) on the engine thread between steps and return its result (e.g. a policy change).
        TimeoutError if the engine thread has not run it within `timeout` seconds (it is then not run)."""
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, ticket))
        try:
            return ticket.result(timeout)
        except concurrent.futures.TimeoutError:
            if ticket.cancel():
                raise TimeoutError(f"the engine thread did not take the call within {timeout} s") from None
            return ticket.result()  # it started just now: its result is on its way

    def drain(self, timeout: float) -> None:
        """Take no new requests, let the running ones finish for up to `timeout` seconds, then shut down (the
        rest end with EngineUnavailable). Returns at once; a thread of its own waits."""
        self._draining = True

        def wait():
            end = time.monotonic() + timeout
            while (self._streams or not self._commands.empty()) and time.monotonic() < end and self.alive:
                time.sleep(0.05)
            self.shutdown()

        threading.Thread(target=wait, name="flexdraft-drain", daemon=True).start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    def inject_fault(self, kind: str) -> None:
        """Test-only: "loop" ends the loop as a bug in it would (a failed step needs no hook: any exception in
        a step is one)."""
        if kind != "loop":
            raise ValueError(f"unknown fault {kind!r}: the only one is loop")
        self._send(("fault", kind))

    def _unavailable(self) -> str:
        if self.death is not None:
            return f"the engine loop died ({self.death}); the replica is unhealthy and will be replaced"
        if self._draining:
            return "this engine was replaced by a reconfigure; retry"
        return "the engine is shut down"

    def _send(self, command: tuple, quiet: bool = False) -> None:
        with self._lock:
            if self._closed:
                if not quiet:
                    self._refuse(command)
                return
            self._commands.put(command)
        self._wake.set()

    def _refuse(self, command: tuple) -> None:
        """Answer a command the loop will never run (it died or was shut down)."""
        error = EngineUnavailable(self._unavailable())
        ticket = command[-1] if command[0] in ("add", "call") else None
        if ticket is not None and ticket.set_running_or_notify_cancel():
            ticket.set_exception(error)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        # OpenMP's thread count is per OS thread: a new thread starts from OMP_NUM_THREADS (Ray sets it to the
        # actor's num_cpus), not from the torch.set_num_threads of the thread that loaded the model
        torch.set_num_threads(self._torch_threads)
        trimmed, steps_then = time.monotonic(), 0
        try:
            while not self._stopped:
                self._drain()
                if self._stats.num_steps > steps_then and time.monotonic() - trimmed > TRIM_EVERY_S:
                    trim_heap()
                    trimmed, steps_then = time.monotonic(), self._stats.num_steps
                if not self.engine.has_work():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._step()
            reason = "the engine is shut down"
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: say so, answer everyone
            self.death = f"{type(e).__name__}: {e}"
            logs.get("serve").error(f"the engine loop died: {self.death}", exc_info=not isinstance(e, _LoopKilled))
            reason = self._unavailable()
        with self._lock:  # from here `_send` refuses: answer what is queued and every open stream
            self._closed = self._stopped = True
            pending = []
            while not self._commands.empty():
                pending.append(self._commands.get_nowait())
        for command in pending:
            self._refuse(command)
        self._fail_all(EngineUnavailable(reason))

    def _step(self) -> None:
        try:
            out: StepOutput = self.engine.step(self._admit_limit)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the replica down
            self._recover(e)
            return
        self._running, self._waiting, self._futile = out.running, out.waiting, 0
        self._probate(out.stats)
        self._deliver(out.deltas)
        self._count(out.stats)
        if self.on_step is not None:
            try:
                self.on_step(out)
            except Exception:  # noqa: BLE001 - metrics must not stop decoding
                logs.get("serve").exception("on_step callback failed")

    def _recover(self, error: Exception) -> None:
        """A step raised: put its requests back with their progress, charge the one that failed alone (or that
        keeps failing), and re-admit the rest one at a time."""
        self.failed_steps += 1
        log = logs.get("serve")
        log.error(f"engine step failed ({type(error).__name__}: {error}); recovering its requests", exc_info=error)
        try:
            recovery = self.engine.recover()
        except Exception as e:  # noqa: BLE001 - the engine cannot even put them back: it is broken
            raise EngineBroken(f"a step failed ({type(error).__name__}: {error}) and so did putting its requests "
                               f"back ({type(e).__name__}: {e})") from e
        moved = recovery.tokens
        self._running, self._waiting = (), recovery.waiting
        self._futile = 0 if moved or recovery.admitted else self._futile + 1
        if self._futile >= MAX_STRIKES:
            raise EngineBroken(f"{self._futile} steps in a row failed before any request was in them: "
                               f"{type(error).__name__}: {error}")
        for rid, tokens in moved.items():  # tokens the failed step made before it raised are still valid
            stream = self._streams.get(rid)
            if stream is not None and len(tokens) > stream.sent:
                logprobs = recovery.logprobs.get(rid)
                self._put(stream, Chunk(RequestDelta(rid, tuple(tokens[stream.sent:]),
                                                     tuple(logprobs[stream.sent:]) if logprobs else None)))
                stream.sent = len(tokens)
        # while isolating, the step's one newcomer (or the one on probation) is the only change to a batch that
        # decoded fine without it
        probing = self._admit_limit is not None
        admitted = recovery.admitted
        alone = admitted[0] if probing and len(admitted) == 1 else \
            self._probation[0] if self._probation and self._probation[0] in moved else None
        waiting = set(recovery.waiting)
        unfinished = [rid for rid in moved if rid in waiting]  # the failed step's requests still to decode
        if alone is not None:
            culprits = [alone]
        else:
            for rid in unfinished:
                self._strikes[rid] = self._strikes.get(rid, 0) + 1
            culprits = [rid for rid in unfinished if self._strikes[rid] >= MAX_STRIKES]
        failure = EngineFailed(f"the engine failed while decoding this request: {type(error).__name__}: {error}")
        for rid in culprits:
            self._end(rid, failure)
        self.charged += len(culprits)
        self._suspects = [rid for rid in unfinished if rid not in culprits] + \
            [rid for rid in self._suspects if rid in waiting and rid not in moved]
        self._probation = []
        self._admit_limit = 1 if self._suspects else None
        for rid in recovery.finished:
            self._finish(rid)

    def _probate(self, stats: StepStats) -> None:
        """After a good step: move the isolation after a failure along (see `_recover`)."""
        if self._probation:
            self._probation[1] -= 1
            if self._probation[1] <= 0 or self._probation[0] not in self._running:
                self._probation = []
        if self._suspects:  # (one whose caller left is no longer waiting)
            self._suspects = [rid for rid in self._suspects if rid in self._waiting or rid in stats.admitted_ids]
        for rid in stats.admitted_ids:
            if rid in self._suspects:
                self._suspects.remove(rid)
                self._probation = [rid, PROBATION_STEPS - 1]
        if self._probation:
            self._admit_limit = 0
        else:
            self._admit_limit = 1 if self._suspects else None
            if not self._suspects:
                self._strikes.clear()

    def _end(self, request_id: int, error: Exception) -> None:
        """End one request with `error` (its stream gets it; the engine forgets it)."""
        try:
            self._forget(request_id)
        except Exception:  # noqa: BLE001 - unknown to the engine, or the engine is broken: the stream still ends
            pass
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put(stream, error)

    def _forget(self, request_id: int) -> None:
        """Abort the request unless it has finished, and take its result: the engine keeps nothing of it."""
        try:
            self.engine.abort(request_id)
        except FlexDraftError:  # it finished: its result waits
            pass
        self.engine.result(request_id)

    def _count(self, stats: StepStats) -> None:
        self.most_rows = max(self.most_rows, stats.rows)
        with self._stats_lock:
            self._stats.observe(stats)

    def stats(self) -> SpecDecodingStats:
        """A snapshot of the step counts since start (the MLflow reporter logs their rates)."""
        with self._stats_lock:
            return self._stats.copy()

    def _drain(self) -> None:
        """Carry out the commands sent since the last step (adds, aborts, calls); none of them can end the loop."""
        command_ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                if command_ran:
                    self._running, self._waiting = self.engine.queue()  # (what `load` reports between steps)
                return
            command_ran = True
            try:
                self._command(command)
            except Exception:  # noqa: BLE001 - a command that fails is that command's problem only
                logs.get("serve").exception(f"engine command {command[0]!r} failed")

    def _command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt, params, group, stream, ticket = command
            if not ticket.set_running_or_notify_cancel():
                return  # the caller left before admission: nothing to add
            try:
                request_id = self.engine.add_request(prompt, params, group)
            except FlexDraftError as e:
                ticket.set_exception(e)
                return
            except Exception as e:  # noqa: BLE001 - whatever the engine refuses, it refuses this request only
                ticket.set_exception(FlexDraftError(f"the engine refused the request: {type(e).__name__}: {e}"))
                return
            stream.request_id = request_id
            self._streams[request_id] = stream
            ticket.set_result(request_id)
        elif kind == "abort":
            rid = command[1].request_id
            if rid is not None and self._streams.get(rid) is command[1]:
                del self._streams[rid]
                self._forget(rid)
                self.aborted += 1
        elif kind == "call":
            _, fn, ticket = command
            if not ticket.set_running_or_notify_cancel():
                return  # the caller gave up waiting
            try:
                ticket.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller gets it
                ticket.set_exception(e)
        elif kind == "fault":
            raise _LoopKilled("injected loop fault")

    def _put(self, stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except Exception:  # noqa: BLE001 - the caller's event loop is closed: nobody is listening
            pass

    def _deliver(self, deltas: tuple[RequestDelta, ...]) -> None:
        """Each delta to its request's stream, unchanged; a finished request's with its generation (it closes)."""
        for delta in deltas:
            stream = self._streams.get(delta.id)
            if stream is None:
                continue
            stream.sent += len(delta.tokens)
            if delta.finish_reason is None:
                self._put(stream, Chunk(delta))
            else:
                del self._streams[delta.id]
                self._put(stream, Chunk(delta, self.engine.result(delta.id)))

    def _finish(self, request_id: int) -> None:
        """A request that finished before a failed step was recovered: its stream gets its generation and closes."""
        if request_id in self._streams:
            stream = self._streams.pop(request_id)
            self._put(stream, Chunk(RequestDelta(request_id, ()), self.engine.result(request_id)))

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self._end(request_id, error)
        self._streams.clear()
