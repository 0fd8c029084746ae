"""The FlexDraft Ray Serve app: one deployment with a FastAPI ingress whose replica owns one engine and runs its
continuous-batching loop (`flexdraft.serving.async_engine.AsyncEngine`), behind OpenAI-compatible routes.

    serve run serve/config.yaml            # or: serve run serve.app:build_app, or: flexdraft serve
    curl 127.0.0.1:8000/v1/completions -d '{"prompt": "2+2=", "max_tokens": 8, "temperature": 0}'

`user_config` is a `flexdraft.serving.config.ServeConfig` (model, drafter, runtime, engine); changing only its policy
knobs reconfigures the live engine, anything else builds a new engine in the replica.
"""

import asyncio
import dataclasses
import hmac
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
import ray
from ray import serve
from starlette.exceptions import HTTPException

from flexdraft.core import logs
from flexdraft.core.config import from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.serving.openai_api import (APIError, TextStream, chunk, finish_reason, fit_to_engine, parse_request, response,
                                  speculation, usage, validation_error)
from flexdraft.serving.protocol import ChatCompletionRequest, CompletionRequest
from flexdraft.engine.stats import SpecDecodingStats
from flexdraft.serving.async_engine import AsyncEngine, EngineFailed, EngineUnavailable
from flexdraft.serving.mlflow_reporter import MlflowReporter
from flexdraft.serving.config import ServeConfig, apply_live, build, check_exposure

app = FastAPI(title="FlexDraft", description="Lossless speculative decoding, OpenAI-compatible")
log = logs.get("serve")
FAULTS_ENV = "FLEXDRAFT_FAULT_INJECTION"  # "1": tests may kill the engine loop through a handle (never in production)


def _sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Guard:
    """ASGI middleware in front of every route: bodies over `max_body_bytes` get 413 before they are read whole,
    and every /v1/ route needs the API key when `$api_key_env` is set (401 before the body is parsed). The replica
    sets both from its user_config."""

    max_body_bytes = 1 << 20
    api_key_env = "FLEXDRAFT_API_KEY"

    def __init__(self, asgi):
        self.asgi = asgi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        key, headers = os.environ.get(self.api_key_env), dict(scope["headers"])
        if key and path.startswith("/v1/"):
            given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
            if not hmac.compare_digest(given, key.encode()):
                return await _send_error(send, APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                        kind="authentication_error", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _send_error(send, self._too_large())
        body, more = [], True
        while more:  # read the body here, bounded, and hand it on whole
            message = await receive()
            if message["type"] != "http.request":
                return await self.asgi(scope, _replay([message], receive), send)
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_body_bytes:
                return await _send_error(send, self._too_large())
        await self.asgi(scope, _replay([{"type": "http.request", "body": b"".join(body), "more_body": False}],
                                       receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


app.add_middleware(Guard)


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError):
    return _error(validation_error(list(exc.errors())))


@app.exception_handler(HTTPException)
async def _http(request: Request, exc: HTTPException):
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(APIError(exc.status_code, str(exc.detail), kind=kind))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    log.error(f"unhandled {type(exc).__name__} on {request.url.path}", exc_info=exc)
    return _error(APIError(500, f"internal error ({type(exc).__name__})", kind="server_error"))


class Metrics:
    """Ray Serve custom metrics (exported to Prometheus by Ray) named as vLLM's spec-decode and request metrics."""

    LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]

    def __init__(self):
        from ray.serve import metrics as m

        self.drafts = m.Counter("flexdraft_spec_decode_num_drafts", "Draft blocks verified (rows x speculative steps)")
        self.draft_tokens = m.Counter("flexdraft_spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = m.Counter("flexdraft_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.per_pos = m.Counter("flexdraft_spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted at each draft position", tag_keys=("position",))
        self.steps = m.Counter("flexdraft_steps", "Engine steps by decoding mode", tag_keys=("mode",))
        self.batch = m.Gauge("flexdraft_batch_size", "Rows decoded in the latest step")
        self.running = m.Gauge("flexdraft_num_requests_running", "Requests decoding")
        self.waiting = m.Gauge("flexdraft_num_requests_waiting", "Requests waiting for a row")
        self.streams = m.Gauge("flexdraft_num_streams", "Callers waiting for tokens (0 when idle: none leaked)")
        self.source = None  # the AsyncEngine whose streams are counted
        self.generated = m.Counter("flexdraft_generation_tokens", "Tokens generated")
        self.ttft = m.Histogram("flexdraft_time_to_first_token_seconds", "Time to first token",
                                boundaries=self.LATENCY_BUCKETS)
        self.tpot = m.Histogram("flexdraft_time_per_output_token_seconds", "Time per output token after the first",
                                boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2])
        self.e2e = m.Histogram("flexdraft_e2e_request_latency_seconds", "End-to-end request latency",
                               boundaries=self.LATENCY_BUCKETS)

    def on_step(self, stats, engine) -> None:
        """Engine thread, after every step."""
        self.steps.inc(tags={"mode": stats.mode})
        self.batch.set(stats.rows)
        self.running.set(engine.active)
        self.waiting.set(len(engine.waiting))
        if self.source is not None:
            self.streams.set(self.source.load()["streams"])
        counts = SpecDecodingStats.of_step(stats)
        if counts.num_drafts:  # (a Ray counter refuses inc(0): a step whose drafts were all rejected accepts 0)
            self.drafts.inc(counts.num_drafts)
            self.draft_tokens.inc(counts.num_draft_tokens)
            if counts.num_accepted_tokens:
                self.accepted.inc(counts.num_accepted_tokens)
            for pos, n in enumerate(counts.num_accepted_tokens_per_pos):
                self.per_pos.inc(n, tags={"position": str(pos)})

    def request_done(self, t0: float, t_first: float | None, tokens: int) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - t0)
        self.generated.inc(tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if tokens > 1:
                self.tpot.observe((now - t_first) / (tokens - 1))


def _engine_error(e: Exception, cfg: ServeConfig) -> APIError:
    """What a request's failure in the engine means to its client."""
    if isinstance(e, TimeoutError):
        return APIError(504, f"the request took longer than request_timeout_s={cfg.request_timeout_s}", kind="timeout")
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), kind="service_unavailable")
    if isinstance(e, EngineFailed):
        return APIError(500, str(e), kind="server_error")
    return APIError(400, str(e), "prompt")


def _rss_mb() -> float:
    """This replica's resident memory."""
    import psutil  # (a dependency of Ray)

    return round(psutil.Process().memory_info().rss / 2 ** 20, 1)


def _proxy_host() -> str | None:
    """The address Serve's HTTP proxies bind to (None when it cannot be read)."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 - unknown: `check_exposure` then fails closed
        return None


@serve.deployment(ray_actor_options={"num_cpus": 2}, max_ongoing_requests=64)
@serve.ingress(app)
class FlexDraftServer:
    """One engine per replica; requests join its batch between steps. No request or client can take it down:
    the engine loop is supervised (serving.AsyncEngine), bodies are validated against the engine's bounds, a
    client that leaves frees its row, and if the loop dies anyway `check_health` fails so Serve replaces it."""

    def __init__(self):
        self.cfg: ServeConfig | None = None
        self.engine: AsyncEngine | None = None
        self.reporter: MlflowReporter | None = None
        self.card: dict[str, str] = {}
        self.metrics = Metrics()
        self.tokenize = ThreadPoolExecutor(1, thread_name_prefix="flexdraft-tokenize")  # off the event loop
        self.replica = serve.get_replica_context().replica_tag

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this at start and on every change of `user_config`. The new config is checked whole
        before anything changes; a new engine takes new requests while the old one finishes its own."""
        try:
            cfg = from_dict(ServeConfig, user_config)
            check_exposure(cfg, _proxy_host())
        except FlexDraftError as e:
            raise ValueError(f"bad user_config: {e}") from None
        if self.engine is not None and not cfg.needs_new_engine(self.cfg):
            try:
                changed = self.engine.call(lambda engine: apply_live(engine, cfg), timeout=cfg.request_timeout_s)
            except (FlexDraftError, TimeoutError) as e:
                raise ValueError(f"bad user_config: {e}") from None
            log.info(f"live engine reconfigured: {changed or 'nothing changed'}")
            self.cfg = cfg
            Guard.max_body_bytes, Guard.api_key_env = cfg.max_body_bytes, cfg.api_key_env
            return
        if self.engine is not None:
            log.info("model, drafter, runtime or engine shape changed: building a new engine in this replica")
        try:  # (e.g. a models:/ drafter that is missing, unreachable or for another target: Serve's status says why)
            lm, engine, note, where = build(cfg)
        except FlexDraftError as e:
            raise ValueError(f"bad user_config: {e}") from None
        old, old_reporter, self.lm, self.cfg = self.engine, self.reporter, lm, cfg
        Guard.max_body_bytes, Guard.api_key_env = cfg.max_body_bytes, cfg.api_key_env
        self.name = cfg.served_model_name or lm.name
        self.engine = self.metrics.source = AsyncEngine(engine, on_step=self.metrics.on_step)
        log.info(f"serving {self.name} {note}")
        ctx = serve.get_replica_context()
        self.card = {"app": ctx.app_name, "deployment": ctx.deployment, **where}  # (/v1/models)
        self.reporter = None
        if cfg.mlflow_every_s:
            try:
                self.reporter = MlflowReporter(
                    self.engine, {**dataclasses.asdict(cfg), "note": note}, f"serve-{self.name}-{ctx.replica_tag}",
                    {"app": ctx.app_name, "deployment": ctx.deployment, "replica": ctx.replica_tag,
                     "ray_node": ray.get_runtime_context().get_node_id(),
                     "version": str(ctx.code_version), "drafter": cfg.drafter or "default",
                     **{f"flexdraft.{k}": v for k, v in where.items()}},
                    every_s=cfg.mlflow_every_s, model_id=where.get("drafter_model_id"))
            except Exception:  # noqa: BLE001 - an unreachable tracking store must not stop serving
                log.exception("no MLflow serving run: the tracking store failed")
            else:
                for run_id in self.reporter.ended:
                    log.info(f"serving run {run_id} of a replica gone without a heartbeat: ended as KILLED")
        if old_reporter is not None:
            old_reporter.stop()
        if old is not None:
            old.drain(cfg.drain_timeout_s)  # its requests finish there; past the timeout they get 503

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is restarted."""
        if self.engine is not None and not self.engine.alive:
            if self.reporter is not None:  # its serving run says how the replica ended
                self.reporter, reporter = None, self.reporter
                reporter.stop("FAILED")
            raise RuntimeError(f"the engine loop is not running: {self.engine.death or 'shut down'}")

    def inject_fault(self, kind: str) -> None:
        """Test-only (with $FLEXDRAFT_FAULT_INJECTION=1 in the replica): "loop" ends the engine loop as a bug
        would."""
        if os.environ.get(FAULTS_ENV) != "1":
            raise PermissionError(f"fault injection is off (${FAULTS_ENV} is not 1 in this replica)")
        self.engine.inject_fault(kind)

    def __del__(self):  # Serve's replica shutdown
        if getattr(self, "reporter", None) is not None:
            self.reporter.stop()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    def health(self):
        """200 with the engine's load while its loop runs; 503 once it has died (Serve then replaces it)."""
        state = {**self.engine.load(), "replica": self.replica, "rss_mb": _rss_mb(),
                 "drafter_version": self.card.get("drafter_version", "")}
        return JSONResponse({"status": "ok" if state["alive"] else "dead", **state},
                            status_code=200 if state["alive"] else 503)

    @app.get("/v1/models")
    def models(self):
        """The served model; its `flexdraft` field names the app, deployment and drafter (registered version, policy)
        a load test records it measured."""
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                            "owned_by": "flexdraft", "flexdraft": self.card}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._generate(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._generate(body, chat=True)

    # ------------------------------------------------------------------ one request

    async def _generate(self, body, chat: bool):
        t0 = time.perf_counter()  # (x-request-id: Serve's proxy honours the client's or makes one, and echoes it)
        engine, cfg = self.engine, self.cfg
        try:  # tokenising and templating a long prompt takes milliseconds: not on the event loop
            req = await asyncio.get_running_loop().run_in_executor(
                self.tokenize, parse_request, body, chat, self.name, self.lm.tokenizer, engine.engine.config.max_len,
                cfg.default_max_tokens)
            fit_to_engine(req, engine.engine)
        except APIError as e:
            return _error(e)
        stream = engine.generate(req.prompt_ids, req.params)
        if req.stream:
            return StreamingResponse(self._events(req, stream, t0, cfg.request_timeout_s),
                                     media_type="text/event-stream")
        text, ids, t_first, last, out = TextStream(self.lm.tokenizer, req.stop), [], None, None, []
        try:
            async with asyncio.timeout(cfg.request_timeout_s):
                async for c in stream:
                    t_first = t_first or time.perf_counter()
                    ids += c.tokens
                    out.append(text.add(c.tokens, final=c.finished is not None))
                    last = c.finished
                    if text.stopped:
                        break
        except (FlexDraftError, EngineFailed, TimeoutError) as e:
            return _error(_engine_error(e, cfg))
        finally:
            await stream.aclose()
        self.metrics.request_done(t0, t_first, len(ids))
        return JSONResponse(response(req, "".join(out), ids, last, text.stopped))

    async def _events(self, req, stream, t0: float, timeout_s: float):
        """Server-sent events: a chunk per engine step that made text, the last with its finish_reason, then usage
        (stream_options.include_usage) and `data: [DONE]`; an error ends the stream with an error event."""
        text, ids, t_first, first = TextStream(self.lm.tokenizer, req.stop), [], None, True
        last = None
        try:
            async with asyncio.timeout(timeout_s):
                async for c in stream:
                    t_first = t_first or time.perf_counter()
                    ids += c.tokens
                    delta = text.add(c.tokens, final=c.finished is not None)
                    last = c.finished
                    done = text.stopped or last is not None
                    if delta or done or first:
                        finish = finish_reason(last, text.stopped) if done else None
                        yield _sse(chunk(req, delta, c.tokens, finish, first=first))
                        first = False
                    if done:
                        break
        except (FlexDraftError, EngineFailed, TimeoutError) as e:
            yield _sse(_engine_error(e, self.cfg).body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await stream.aclose()
        if req.include_usage:
            yield _sse(chunk(req, None) | {"usage": usage(req, len(ids)), "flexdraft": speculation(last)})
        self.metrics.request_done(t0, t_first, len(ids))
        yield "data: [DONE]\n\n"


def build_app(args: dict | None = None):
    """The app builder for `serve run serve.app:build_app` and config files (`import_path`). args: a ServeConfig
    as a dict (e.g. `serve run serve.app:build_app model=...` passes strings: use a config file for more)."""
    return FlexDraftServer.options(user_config=dict(args or {})).bind()
