"""Serving one engine to many concurrent callers: `AsyncEngine` owns an `Engine` on one thread (the only thread
that touches it) and runs the continuous-batching loop there: requests join between steps, each request's new
tokens flow back through its own asyncio queue, finished and aborted ones leave. The adaptive policy sees the
live batch every step. The Serve deployment (serve/app.py) wraps it; nothing here knows Ray."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from flexdraft import logs
from flexdraft.config import RuntimeConfig, from_dict
from flexdraft.engine import Engine
from flexdraft.engine_config import EngineConfig, StepStats
from flexdraft.errors import FlexDraftError
from flexdraft.generate import Generation, SamplingParams
from flexdraft.policy_file import POLICY_KEYS

# EngineConfig fields a live engine takes between two steps (policy knobs); any other change needs a new engine
LIVE_KNOBS = ("switch_batch", "top_m", "rho", "calibrate", "cost_model")


@dataclass
class ServeConfig:
    """What one replica serves (Serve's `user_config`): the model, the drafter, the runtime and the engine."""
    model: str = "smollm2"
    drafter: str = ""  # "" = the default pipeline's if trained, else no drafter (see `build`); a folder; "init"
    store: str = ""  # n-gram store of lookup steps: "" = the default pipeline's distilled data, a file, "none"
    served_model_name: str = ""  # the `model` clients name ("" = the model source's name)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    engine: dict = field(default_factory=dict)  # EngineConfig fields (mode, switch_batch, max_batch, ...)
    policy: str = ""  # a policy file from `flexdraft sweep`: it sets mode, S, B', pruning per live batch size
    default_max_tokens: int = 256  # new tokens of a request that names no max_tokens
    api_key_env: str = "FLEXDRAFT_API_KEY"  # when this variable is set, requests need `Authorization: Bearer <it>`
    mlflow_every_s: float = 30.0  # a serving run in MLflow, a point every this many seconds (0 = none)
    request_timeout_s: float = 600.0  # a request still decoding after this long ends with 504 (its row freed)
    drain_timeout_s: float = 60.0  # a reconfigure that needs a new engine lets the old one finish this long
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are read whole
    insecure: bool = False  # serve beyond loopback without an API key (refused otherwise: fail closed)

    def __post_init__(self):
        self.engine_config()  # unknown engine keys and wrong types, named
        both = [k for k in POLICY_KEYS if k in self.engine] if self.policy else []
        if both:
            raise FlexDraftError(f"user_config.engine.{both[0]} is set by the policy file {self.policy}: remove "
                                 f"{', '.join(both)} from engine (or the policy)")

        if self.request_timeout_s <= 0 or self.drain_timeout_s < 0 or self.max_body_bytes < 1024:
            raise FlexDraftError("request_timeout_s must be > 0, drain_timeout_s >= 0 and max_body_bytes >= 1024")

    def engine_config(self) -> EngineConfig:
        return from_dict(EngineConfig, self.engine, ".engine")

    def needs_new_engine(self, other: "ServeConfig") -> bool:
        """Whether going from `other` to this config changes more than the live knobs."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        for d in (a, b):
            d["engine"] = {k: v for k, v in d["engine"].items() if k not in LIVE_KNOBS}
        return a != b


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_exposure(cfg: ServeConfig, host: str | None, environ=os.environ) -> None:
    """Fail closed: serving on a non-loopback address (or one not known) needs an API key in
    `cfg.api_key_env`, unless `cfg.insecure` says otherwise."""
    if environ.get(cfg.api_key_env) or cfg.insecure or (host is not None and host in LOOPBACK_HOSTS):
        return
    raise FlexDraftError(f"refusing to serve on {host or 'an unknown address'} without an API key: set "
                         f"${cfg.api_key_env} in the replicas' environment (flexdraft serve forwards it), bind to "
                         "127.0.0.1, or set user_config.insecure: true (flexdraft serve --insecure)")


def build(cfg: ServeConfig):
    """-> (loaded model, engine, a note saying what it serves). Without a drafter (none trained yet) an
    adaptive config serves in lookup mode: prompt-lookup and n-gram-store drafts verified by the target, AR steps
    where no row has a match; lossless and fast before anything is trained."""
    from flexdraft.runner import load_engine

    ec = cfg.engine_config()
    drafter = cfg.drafter or None
    if ec.mode == "adaptive" and not cfg.drafter and not cfg.policy:
        from flexdraft.pipeline import default_drafter_dir

        if not (default_drafter_dir() / "drafter.json").is_file():
            ec.mode = "lookup"
            logs.get("serve").info(f"no trained drafter ({default_drafter_dir()} does not exist): serving in lookup "
                                   "mode (prompt lookup + n-gram store, AR steps elsewhere); train one with "
                                   "`flexdraft pipeline`")
    lm, engine, note = load_engine(cfg.model, cfg.runtime, drafter, ec, store_spec=cfg.store or None,
                                   policy_spec=cfg.policy or None)
    return lm, engine, note


def apply_live(engine: Engine, cfg: ServeConfig) -> dict:
    """Set the live knobs of `cfg.engine` on a running engine (on its thread: `AsyncEngine.call`) -> the changes."""
    new = cfg.engine_config()
    knobs = [k for k in LIVE_KNOBS if engine.policy is None or k not in POLICY_KEYS]  # (a policy's are its own)
    changed = {k: getattr(new, k) for k in knobs if getattr(new, k) != getattr(engine.config, k)}
    trial = dataclasses.replace(engine.config, **changed)  # checked whole before any of it is applied
    trial.check(engine.drafter, engine.target.args.max_position_embeddings)
    for k, v in changed.items():
        setattr(engine.config, k, v)
    engine.planner.switch_batch, engine.planner.cost_model = engine.config.switch_batch, engine.config.cost_model
    engine.planner.forget_plans()
    return changed


def spec_counts(stats: StepStats) -> dict:
    """One step's speculative-decoding counts, as vLLM counts them: drafts (rows verified), draft tokens, accepted
    tokens and, per draft position j (0-based), how many rows accepted draft j. AR steps count nothing."""
    if stats.mode in ("ar", "idle", "profile") or not stats.accepted:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    acc = stats.accepted
    return {"drafts": len(acc), "draft_tokens": len(acc) * stats.block, "accepted": sum(acc),
            "per_position": [sum(a > j for a in acc) for j in range(max(acc))]}


class EngineFailed(RuntimeError):
    """The engine failed while decoding this request (it ends with this error; the other requests go on)."""


class EngineUnavailable(EngineFailed):
    """The engine is not taking requests: shut down, replaced by a reconfigure, or its loop died. Retry later."""


@dataclass
class Chunk:
    """One item of a request's stream: new token ids, and on the last one the finished generation."""
    tokens: list[int]
    finished: Generation | None = None


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


class AsyncEngine:
    """`async for chunk in engine.generate(prompt_ids, params)`: the request's tokens as the engine makes them.
    A caller that stops iterating or is cancelled at any await (a client gone before admission, mid-stream or
    mid-step) aborts its request: its row and stream are freed at the next step. `on_step(stats, engine)` runs
    on the engine thread after every step (metrics).

    The loop is supervised: an exception in a command, a callback or a step never ends it. A failed step's
    requests go back to the queue with the tokens they made (`Engine.recover`) and rejoin one at a time, each
    decoding `PROBATION_STEPS` steps before the next joins, so a request that fails again alone is the one
    charged with the error while the others' outputs stay what they would have been. If the loop still ends
    (a bug), `alive` turns False, every waiting caller gets EngineUnavailable at once and so do new ones."""

    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Engine], None] | None = None):
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
        # running totals since start (the MLflow reporter logs their rates): tokens, rows, drafts, ..., steps_<mode>
        self.totals: dict[str, float] = {}
        self._strikes: dict[int, int] = {}  # request id -> failed steps it was in
        self._suspects: list[int] = []  # failed step's requests not yet re-admitted, in queue order
        self._probation: list = []  # [request id, steps left] of the request decoding alone after a failure
        self._fault: str | None = None
        self._torch_threads = torch.get_num_threads()  # what the model was loaded for (RuntimeConfig.threads)
        self._thread = threading.Thread(target=self._run, name="flexdraft-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (any thread / event loop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.death is None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Raises FlexDraftError (before any token) for a request the engine refuses, EngineFailed if the engine
        fails while decoding it, EngineUnavailable if it takes no requests."""
        if self._draining or self._stopped or not self.alive:
            raise EngineUnavailable(self._unavailable())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        done = False
        try:
            self._send(("add", list(prompt_ids), params, stream, ticket))
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
        return {"alive": self.alive, "running": self.engine.active, "waiting": len(self.engine.waiting),
                "streams": len(self._streams), "steps": self.totals.get("steps", 0), "most_rows": self.most_rows,
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
        """Test-only: "step" makes the next step raise (recovered as any failed step); "loop" ends the loop as
        a bug in it would."""
        if kind not in ("step", "loop"):
            raise ValueError(f"unknown fault {kind!r}: step or loop")
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
        try:
            while not self._stopped:
                self._drain()
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
            if self._fault == "step":
                self._fault = None
                raise RuntimeError("injected step fault")
            out = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the replica down
            self._recover(e)
            return
        stats = self.engine.last_stats
        self._probate(stats)
        self._deliver(out)
        self._count(stats, out)
        if self.on_step is not None:
            try:
                self.on_step(stats, self.engine)
            except Exception:  # noqa: BLE001 - metrics must not stop decoding
                logs.get("serve").exception("on_step callback failed")

    def _recover(self, error: Exception) -> None:
        """A step raised: put its requests back with their progress, charge the one that failed alone (or that
        keeps failing), and re-admit the rest one at a time."""
        self.failed_steps += 1
        log = logs.get("serve")
        log.error(f"engine step failed ({type(error).__name__}: {error}); recovering its requests", exc_info=error)
        try:
            moved = self.engine.recover()
        except Exception:  # noqa: BLE001 - the engine cannot even put them back: end them all
            log.exception("engine recovery failed; ending every request")
            self._fail_all(EngineFailed(f"the engine failed while decoding: {type(error).__name__}: {error}"))
            self.engine.waiting.clear()
            return
        for rid, tokens in moved.items():  # tokens the failed step made before it raised are still valid
            stream = self._streams.get(rid)
            if stream is not None and len(tokens) > stream.sent:
                self._put(stream, Chunk(tokens[stream.sent:]))
                stream.sent = len(tokens)
        # while isolating, the step's one newcomer (or the one on probation) is the only change to a batch that
        # decoded fine without it
        probing = self.engine.admit_limit is not None
        admitted = self.engine.last_stats.admitted_ids
        alone = admitted[0] if probing and len(admitted) == 1 else \
            self._probation[0] if self._probation and self._probation[0] in moved else None
        if alone is not None:
            culprits = [alone]
        else:
            for rid in moved:
                self._strikes[rid] = self._strikes.get(rid, 0) + 1
            culprits = [rid for rid in moved if self._strikes[rid] >= MAX_STRIKES]
        failure = EngineFailed(f"the engine failed while decoding this request: {type(error).__name__}: {error}")
        for rid in culprits:
            self._end(rid, failure)
        self.charged += len(culprits)
        waiting = {r.id for r in self.engine.waiting}
        self._suspects = [rid for rid in moved if rid in waiting and rid not in culprits] + \
            [rid for rid in self._suspects if rid in waiting and rid not in moved]
        self._probation = []
        self.engine.admit_limit = 1 if self._suspects else None
        self._deliver({})

    def _probate(self, stats: StepStats) -> None:
        """After a good step: move the isolation after a failure along (see `_recover`)."""
        if self._probation:
            self._probation[1] -= 1
            if self._probation[1] <= 0 or self._probation[0] not in {r.id for r in self.engine.slots}:
                self._probation = []
        if self._suspects:  # (one whose caller left is no longer waiting)
            waiting = {r.id for r in self.engine.waiting}
            self._suspects = [rid for rid in self._suspects if rid in waiting or rid in stats.admitted_ids]
        for rid in stats.admitted_ids:
            if rid in self._suspects:
                self._suspects.remove(rid)
                self._probation = [rid, PROBATION_STEPS - 1]
        if self._probation:
            self.engine.admit_limit = 0
        else:
            self.engine.admit_limit = 1 if self._suspects else None
            if not self._suspects:
                self._strikes.clear()

    def _end(self, request_id: int, error: Exception) -> None:
        """End one request with `error` (its stream gets it; the engine forgets it)."""
        try:
            if request_id not in self.engine.finished:
                self.engine.abort(request_id)
            self.engine.result(request_id)
        except Exception:  # noqa: BLE001 - unknown to the engine, or the engine is broken: the stream still ends
            pass
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put(stream, error)

    def _count(self, stats: StepStats, out: dict[int, list[int]]) -> None:
        self.most_rows = max(self.most_rows, stats.rows)
        counts = spec_counts(stats)
        for key, value in (("steps", 1), (f"steps_{stats.mode}", 1), ("rows", stats.rows),
                           ("tokens", sum(map(len, out.values()))), ("drafts", counts["drafts"]),
                           ("draft_tokens", counts["draft_tokens"]), ("accepted", counts["accepted"])):
            self.totals[key] = self.totals.get(key, 0) + value

    def _drain(self) -> None:
        """Carry out the commands sent since the last step (adds, aborts, calls); none of them can end the loop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._command(command)
            except Exception:  # noqa: BLE001 - a command that fails is that command's problem only
                logs.get("serve").exception(f"engine command {command[0]!r} failed")

    def _command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt, params, stream, ticket = command
            if not ticket.set_running_or_notify_cancel():
                return  # the caller left before admission: nothing to add
            try:
                request_id = self.engine.add_request(prompt, params)
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
                if rid not in self.engine.finished:
                    self.engine.abort(rid)
                self.engine.result(rid)
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
            if command[1] == "loop":
                raise _LoopKilled("injected loop fault")
            self._fault = command[1]

    def _put(self, stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except Exception:  # noqa: BLE001 - the caller's event loop is closed: nobody is listening
            pass

    def _deliver(self, out: dict[int, list[int]]) -> None:
        for request_id, tokens in out.items():
            stream = self._streams.get(request_id)
            if stream is not None and tokens:
                stream.sent += len(tokens)
                self._put(stream, Chunk(tokens))
        for request_id in [r for r in self.engine.finished if r in self._streams]:
            self._put(self._streams.pop(request_id), Chunk([], self.engine.result(request_id)))

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self._end(request_id, error)
        self._streams.clear()


class MlflowReporter:
    """A serving run in MLflow: the replica's config as params, then every `every_s` seconds the rates since the
    last report (tokens/s, steps/s, mean batch, mean accepted length, mode shares) and the load, at step = seconds
    since the start, so the dashboard shows the deployment over time. Its own thread; `stop()` ends the run."""

    def __init__(self, engine: AsyncEngine, params: dict, run_name: str, tags: dict | None = None,
                 experiment: str = "flexdraft-serve", every_s: float = 30.0):
        from mlflow.tracking import MlflowClient

        from flexdraft.tracking import experiment_id, flatten, ready_store

        self.engine, self.every_s = engine, every_s
        self.client = MlflowClient(ready_store())
        exp_id = experiment_id(self.client, experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        for key, value in list(flatten(params).items())[:100]:
            self.client.log_param(self.run_id, key, str(value)[:500])
        self.t0 = time.time()
        self._last = (self.t0, dict(engine.totals))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flexdraft-mlflow", daemon=True)
        self._thread.start()

    def report(self) -> dict:
        """Log one point now -> the metrics logged."""
        now, totals = time.time(), dict(self.engine.totals)
        t_prev, prev = self._last
        self._last = (now, totals)
        d = {k: totals.get(k, 0) - prev.get(k, 0) for k in totals}
        dt, steps = max(now - t_prev, 1e-9), d.get("steps", 0)
        metrics = {"serve/tokens_per_s": d.get("tokens", 0) / dt, "serve/steps_per_s": steps / dt,
                   "serve/running": self.engine.engine.active, "serve/waiting": len(self.engine.engine.waiting),
                   "serve/aborted_total": self.engine.aborted}
        if steps:
            metrics["serve/mean_batch"] = d.get("rows", 0) / steps
            for key, value in d.items():
                if key.startswith("steps_"):
                    metrics[f"serve/mode_share/{key.removeprefix('steps_')}"] = value / steps
        if d.get("drafts"):
            metrics["spec_decode/mean_accepted_length"] = 1 + d["accepted"] / d["drafts"]
            metrics["spec_decode/draft_acceptance_rate"] = d["accepted"] / max(d["draft_tokens"], 1)
        from mlflow.entities import Metric

        ts, step = int(now * 1000), int(now - self.t0)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])
        return metrics

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.report()
            except Exception:  # noqa: BLE001 - a tracking hiccup must not stop serving
                logs.get("serve").exception("MLflow report failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.report()
            self.client.set_terminated(self.run_id)
        except Exception:  # noqa: BLE001
            logs.get("serve").exception("MLflow report failed")
