"""Serving one engine to many concurrent callers: `AsyncEngine` owns an `Engine` on one thread (the only thread
that touches it) and runs the continuous-batching loop there: requests join between steps, each request's new
tokens flow back through its own asyncio queue, finished and aborted ones leave. The adaptive policy sees the
live batch every step. The Serve deployment (serve/app.py) wraps it; nothing here knows Ray."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
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

    def __post_init__(self):
        self.engine_config()  # unknown engine keys and wrong types, named
        both = [k for k in POLICY_KEYS if k in self.engine] if self.policy else []
        if both:
            raise FlexDraftError(f"user_config.engine.{both[0]} is set by the policy file {self.policy}: remove "
                                 f"{', '.join(both)} from engine (or the policy)")

    def engine_config(self) -> EngineConfig:
        return from_dict(EngineConfig, self.engine, ".engine")

    def needs_new_engine(self, other: "ServeConfig") -> bool:
        """Whether going from `other` to this config changes more than the live knobs."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        for d in (a, b):
            d["engine"] = {k: v for k, v in d["engine"].items() if k not in LIVE_KNOBS}
        return a != b


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
    for k, v in changed.items():
        setattr(engine.config, k, v)
    engine.config.check(engine.drafter, engine.target.args.max_position_embeddings)
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
    """The engine raised during a step: the requests it was decoding end with this error; the loop goes on."""


@dataclass
class Chunk:
    """One item of a request's stream: new token ids, and on the last one the finished generation."""
    tokens: list[int]
    finished: Generation | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """`async for chunk in engine.generate(prompt_ids, params)`: the request's tokens as the engine makes them.
    A caller that stops iterating (a client gone mid-stream) aborts its request: its row is freed at the next
    step. `on_step(stats, engine)` runs on the engine thread after every step (metrics)."""

    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Engine], None] | None = None):
        self.engine, self.on_step = engine, on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._stopped = False
        self.aborted = 0  # requests aborted because their caller went away
        self.most_rows = 0  # the largest batch a step has decoded
        # running totals since start (the MLflow reporter logs their rates): tokens, rows, drafts, ..., steps_<mode>
        self.totals: dict[str, float] = {}
        self._torch_threads = torch.get_num_threads()  # what the model was loaded for (RuntimeConfig.threads)
        self._thread = threading.Thread(target=self._run, name="flexdraft-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (any thread / event loop)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Raises FlexDraftError (before any token) for a request the engine refuses, EngineFailed if the engine
        fails while decoding it."""
        if self._stopped:
            raise EngineFailed("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", list(prompt_ids), params, stream, ticket))
        request_id = await asyncio.wrap_future(ticket)
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = item.finished is not None
                yield item
                if done:
                    return
        finally:
            if not done:  # the caller stopped early (disconnect, cancellation): free the row
                self._send(("abort", request_id))

    def load(self) -> dict:
        """Rows decoding and requests waiting (read without locking: a snapshot for metrics and health)."""
        return {"running": self.engine.active, "waiting": len(self.engine.waiting), "streams": len(self._streams),
                "steps": self.totals.get("steps", 0), "most_rows": self.most_rows, "aborted": self.aborted}

    def call(self, fn: Callable[[Engine], object]) -> object:
        """Run fn(engine) on the engine thread between steps and return its result (e.g. a policy change)."""
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, ticket))
        return ticket.result()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        # OpenMP's thread count is per OS thread: a new thread starts from OMP_NUM_THREADS (Ray sets it to the
        # actor's num_cpus), not from the torch.set_num_threads of the thread that loaded the model
        torch.set_num_threads(self._torch_threads)
        while not self._stopped:
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                out = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not take the replica down
                logs.get("serve").exception("engine step failed; ending the requests it was decoding")
                self._fail_all(EngineFailed(f"the engine failed while decoding: {type(e).__name__}: {e}"))
                continue
            self._deliver(out)
            self._count(self.engine.last_stats, out)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine.last_stats, self.engine)
                except Exception:  # noqa: BLE001 - metrics must not stop decoding
                    logs.get("serve").exception("on_step callback failed")
        self._fail_all(EngineFailed("the engine is shut down"))

    def _count(self, stats: StepStats, out: dict[int, list[int]]) -> None:
        self.most_rows = max(self.most_rows, stats.rows)
        counts = spec_counts(stats)
        for key, value in (("steps", 1), (f"steps_{stats.mode}", 1), ("rows", stats.rows),
                           ("tokens", sum(map(len, out.values()))), ("drafts", counts["drafts"]),
                           ("draft_tokens", counts["draft_tokens"]), ("accepted", counts["accepted"])):
            self.totals[key] = self.totals.get(key, 0) + value

    def _drain(self) -> None:
        """Carry out the commands sent since the last step (adds, aborts, calls)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, prompt, params, stream, ticket = command
                try:
                    request_id = self.engine.add_request(prompt, params)
                except FlexDraftError as e:
                    ticket.set_exception(e)
                    continue
                self._streams[request_id] = stream
                ticket.set_result(request_id)
            elif kind == "abort":
                request_id = command[1]
                if request_id in self._streams:
                    del self._streams[request_id]
                    self.engine.abort(request_id)
                    self.engine.result(request_id)
                    self.aborted += 1
            elif kind == "call":
                _, fn, ticket = command
                try:
                    ticket.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    ticket.set_exception(e)

    def _put(self, stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _deliver(self, out: dict[int, list[int]]) -> None:
        for request_id, tokens in out.items():
            stream = self._streams.get(request_id)
            if stream is not None and tokens:
                self._put(stream, Chunk(tokens))
        for request_id in [r for r in self.engine.finished if r in self._streams]:
            self._put(self._streams.pop(request_id), Chunk([], self.engine.result(request_id)))

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                if request_id not in self.engine.finished:
                    self.engine.abort(request_id)
                self.engine.result(request_id)
            except FlexDraftError:
                pass
            self._put(stream, error)
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
