"""The FlexDraft Ray Serve app: one deployment with a FastAPI ingress whose replica owns one engine and runs its
continuous-batching loop (`flexdraft.serving.async_engine.AsyncEngine`), behind OpenAI-compatible routes.

    serve run serve/config.yaml            # or: serve run serve.app:build_app, or: flexdraft serve
    curl 127.0.0.1:8000/v1/completions -d '{"prompt": "2+2=", "max_tokens": 8, "temperature": 0}'

`user_config` is a `flexdraft.serving.config.ServeConfig` (model, drafter, runtime, engine); changing only its policy
knobs reconfigures the live engine, anything else builds a new engine in the replica.
"""

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from flexdraft.core import logs
from flexdraft.core.config import from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.serving.async_engine import AsyncEngine, Chunk, EngineFailed, EngineUnavailable, built_apart
from flexdraft.serving.config import ServeConfig, apply_live, build, check_exposure
from flexdraft.serving.grammar_compiler import GrammarCompiler
from flexdraft.serving.metrics import Metrics
from flexdraft.serving.middleware import Guard, GuardSettings
from flexdraft.serving.mlflow_reporter import MlflowReporter
from flexdraft.serving.openai_api import (
    APIError,
    TextStream,
    TokenTexts,
    best,
    choice,
    choice_params,
    chunk,
    compile_grammar,
    finish_reason,
    fit_to_engine,
    logprobs_body,
    parse_request,
    response,
    speculation,
    sse,
    usage,
    validation_error,
)
from flexdraft.serving.protocol import ChatCompletionRequest, CompletionRequest

app = FastAPI(title="FlexDraft", description="Lossless speculative decoding, OpenAI-compatible")
log = logs.get("serve")
FAULTS_ENV = "FLEXDRAFT_FAULT_INJECTION"  # "1": tests may kill the engine loop through a handle (never in production)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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


def _engine_error(e: Exception, cfg: ServeConfig) -> APIError:
    """What a request's failure in the engine means to its client."""
    if isinstance(e, APIError):
        return e
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


class Reader:
    """One request's token stream read into text, for the JSON and the SSE response alike: `read` yields each
    chunk with the text it completed, until the request finished or a stop sequence ended the text, and closes
    the stream whatever happens (a client gone, a timeout: the engine frees the row)."""

    def __init__(self, stream: AsyncIterator[Chunk], text: TextStream):
        self.stream, self.text = stream, text
        self.ids: list[int] = []
        self.logprobs: list = []  # one per id, when the request asks for them
        self.last = None  # the finished generation, once it came
        self.t_first: float | None = None
        self.done = False

    async def read(self, timeout_s: float) -> AsyncIterator[tuple[Chunk, str]]:
        try:
            async with asyncio.timeout(timeout_s):
                async for c in self.stream:
                    self.t_first = self.t_first or time.perf_counter()
                    if c.finished is not None and c.finished.finish_reason == "error":  # (its text would not parse)
                        raise APIError(400, f"'response_format': {c.finished.error}", "response_format",
                                       code="grammar_failed")
                    self.ids += c.tokens
                    self.logprobs += c.logprobs or []
                    delta = self.text.add(c.tokens, final=c.finished is not None)
                    self.last = c.finished
                    self.done = self.text.stopped or self.last is not None
                    yield c, delta
                    if self.done:
                        return
        finally:
            await self.stream.aclose()

    async def whole(self, timeout_s: float) -> str:
        """The choice's whole text."""
        return "".join([delta async for _, delta in self.read(timeout_s)])

    async def chunks(self, req, texts: TokenTexts, index: int, timeout_s: float) -> AsyncIterator[dict]:
        """The choice's stream chunks: one per engine step that made text (carrying every token since the last
        chunk, with their logprobs where asked), the last with its finish_reason."""
        sent = offset = 0  # tokens in chunks so far; characters of their tokens' texts (completions' text_offset)
        first = True
        async for _, delta in self.read(timeout_s):
            if delta or self.done or first:
                finish = finish_reason(self.last, self.text.stopped) if self.done else None
                logprobs = logprobs_body(req, texts, self.logprobs[sent:], offset)
                if logprobs is not None and not req.chat:
                    offset += sum(map(len, logprobs["tokens"]))
                yield chunk(req, delta, self.ids[sent:], finish, first=first, logprobs=logprobs, index=index)
                sent, first = len(self.ids), False


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
        self.compile = ThreadPoolExecutor(1, thread_name_prefix="flexdraft-grammar")  # (slow ones delay no prompt)
        self.compiler: GrammarCompiler | None = None
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
            Guard.configure(GuardSettings(cfg.max_body_bytes, cfg.api_key_env))
            return
        if self.engine is not None:
            log.info("model, drafter, runtime or engine shape changed: building a new engine in this replica")
        try:  # (e.g. a models:/ drafter that is missing, unreachable or for another target: Serve's status says why)
            lm, engine, note, where = built_apart(lambda: build(cfg))
        except FlexDraftError as e:
            raise ValueError(f"bad user_config: {e}") from None
        old, old_reporter, old_compiler, self.lm, self.cfg = self.engine, self.reporter, self.compiler, lm, cfg
        self.compiler = GrammarCompiler(engine.grammars, cfg.grammar_timeout_s) if engine.grammars else None
        if self.compiler is not None:
            self.compile.submit(self.compiler.start)  # (its child starts beside the first requests)
        self.texts = TokenTexts(lm.tokenizer)
        Guard.configure(GuardSettings(cfg.max_body_bytes, cfg.api_key_env))
        self.name = cfg.served_model_name or lm.name
        self.engine = self.metrics.source = AsyncEngine(engine, on_step=self.metrics.on_step)
        log.info(f"serving {self.name} {note}")
        ctx = serve.get_replica_context()
        self.card = {"app": ctx.app_name, "deployment": ctx.deployment, "mode": str(engine.config.mode),
                     **where}  # (/v1/models)
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
        if old_compiler is not None:
            old_compiler.close()
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
        if getattr(self, "compiler", None) is not None:
            self.compiler.close()

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
        engine, cfg, compiler = self.engine, self.cfg, self.compiler
        loop = asyncio.get_running_loop()
        try:  # tokenising and templating a long prompt takes milliseconds: not on the event loop
            req = await loop.run_in_executor(self.tokenize, parse_request, body, chat, self.name, self.lm.tokenizer,
                                             engine.engine.config.max_len, cfg.default_max_tokens)
            fit_to_engine(req, engine.engine)
            if req.params.grammar is not None:  # (compiled apart from the engine thread and the replica's process)
                await loop.run_in_executor(self.compile, compile_grammar, req, compiler)
        except APIError as e:
            return _error(e)
        except EngineUnavailable as e:
            return _error(_engine_error(e, cfg))
        # each choice is a request of its own in the engine's batch (they share the prompt's prefill)
        readers = [Reader(engine.generate(req.prompt_ids, params, req.client), TextStream(self.lm.tokenizer, req.stop))
                   for params in choice_params(req)]
        if req.stream:
            return StreamingResponse(self._events(req, readers, t0, cfg.request_timeout_s),
                                     media_type="text/event-stream")
        failure = None
        try:  # (a choice that fails cancels the others: their rows are freed)
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(r.whole(cfg.request_timeout_s)) for r in readers]
        except* (FlexDraftError, EngineFailed, TimeoutError, APIError) as failed:
            failure = failed.exceptions[0]
        if failure is not None:
            return _error(_engine_error(failure, cfg))
        self._done(t0, readers)
        kept = best([r.last for r in readers], req.n) if req.best_of > req.n else range(req.n)
        choices = [choice(req, i, tasks[k].result(), readers[k].ids, readers[k].last, readers[k].text.stopped,
                          logprobs_body(req, self.texts, readers[k].logprobs)) for i, k in enumerate(kept)]
        return JSONResponse(response(req, choices, sum(len(r.ids) for r in readers), [r.last for r in readers]))

    def _done(self, t0: float, readers: list[Reader]) -> None:
        firsts = [r.t_first for r in readers if r.t_first is not None]
        self.metrics.request_done(t0, min(firsts) if firsts else None, sum(len(r.ids) for r in readers))

    async def _events(self, req, readers: list[Reader], t0: float, timeout_s: float):
        """Server-sent events: each choice's chunks as its engine steps make text (`Reader.chunks`), interleaved,
        then usage (stream_options.include_usage) and `data: [DONE]`; an error ends the stream with an error
        event. A client that leaves cancels every choice (their rows are freed)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, reader: Reader):  # one choice's chunks into the queue, then None or its error
            try:
                async for body in reader.chunks(req, self.texts, index, timeout_s):
                    await queue.put(body)
                await queue.put(None)
            except (FlexDraftError, EngineFailed, TimeoutError, APIError) as e:
                await queue.put(_engine_error(e, self.cfg))
            except Exception as e:  # noqa: BLE001 - a bug: the stream still ends, with a 500 event
                log.error(f"stream of choice {index} failed: {type(e).__name__}", exc_info=e)
                await queue.put(APIError(500, f"internal error ({type(e).__name__})", kind="server_error"))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(readers)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, APIError):
                    yield sse(item.body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield sse(item)
        finally:
            for task in tasks:
                task.cancel()
        if req.include_usage:
            yield sse(chunk(req, None) | {"usage": usage(req, sum(len(r.ids) for r in readers)),
                                          "flexdraft": speculation([r.last for r in readers])})
        self._done(t0, readers)
        yield "data: [DONE]\n\n"


def build_app(args: dict | None = None):
    """The app builder for `serve run serve.app:build_app` and config files (`import_path`). args: a ServeConfig
    as a dict (e.g. `serve run serve.app:build_app model=...` passes strings: use a config file for more)."""
    return FlexDraftServer.options(user_config=dict(args or {})).bind()
