"""The FlexDraft Ray Serve app: one deployment with a FastAPI ingress whose replica owns one engine and runs its
continuous-batching loop (`flexdraft.serving.AsyncEngine`), behind OpenAI-compatible routes.

    serve run serve/config.yaml            # or: serve run serve.app:build_app, or: flexdraft serve
    curl 127.0.0.1:8000/v1/completions -d '{"prompt": "2+2=", "max_tokens": 8, "temperature": 0}'

`user_config` is a `flexdraft.serving.ServeConfig` (model, drafter, runtime, engine); changing only its policy
knobs reconfigures the live engine, anything else builds a new engine in the replica.
"""

import dataclasses
import hmac
import json
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from flexdraft import logs
from flexdraft.config import from_dict
from flexdraft.errors import FlexDraftError
from flexdraft.openai_api import (APIError, TextStream, chunk, finish_reason, fit_to_engine, parse_request, response,
                                  speculation, usage)
from flexdraft.serving import AsyncEngine, EngineFailed, MlflowReporter, ServeConfig, apply_live, build, spec_counts

app = FastAPI(title="FlexDraft", description="Lossless speculative decoding, OpenAI-compatible")
log = logs.get("serve")


def _sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


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
        counts = spec_counts(stats)
        if counts["drafts"]:  # (a Ray counter refuses inc(0): a step whose drafts were all rejected accepts 0)
            self.drafts.inc(counts["drafts"])
            self.draft_tokens.inc(counts["draft_tokens"])
            if counts["accepted"]:
                self.accepted.inc(counts["accepted"])
            for pos, n in enumerate(counts["per_position"]):
                self.per_pos.inc(n, tags={"position": str(pos)})

    def request_done(self, t0: float, t_first: float | None, tokens: int) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - t0)
        self.generated.inc(tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if tokens > 1:
                self.tpot.observe((now - t_first) / (tokens - 1))


@serve.deployment(ray_actor_options={"num_cpus": 2}, max_ongoing_requests=64)
@serve.ingress(app)
class FlexDraftServer:
    """One engine per replica; requests join its batch between steps."""

    def __init__(self):
        self.cfg: ServeConfig | None = None
        self.engine: AsyncEngine | None = None
        self.reporter: MlflowReporter | None = None
        self.metrics = Metrics()

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this at start and on every change of `user_config`."""
        try:
            cfg = from_dict(ServeConfig, user_config)
        except FlexDraftError as e:
            raise ValueError(f"bad user_config: {e}") from None
        if self.engine is not None and not cfg.needs_new_engine(self.cfg):
            changed = self.engine.call(lambda engine: apply_live(engine, cfg))
            log.info(f"live engine reconfigured: {changed or 'nothing changed'}")
            self.cfg = cfg
            return
        if self.engine is not None:
            log.info("model, drafter, runtime or engine shape changed: building a new engine in this replica")
        lm, engine, note = build(cfg)
        old, old_reporter, self.lm, self.cfg = self.engine, self.reporter, lm, cfg
        self.name = cfg.served_model_name or lm.name
        self.engine = AsyncEngine(engine, on_step=self.metrics.on_step)
        log.info(f"serving {self.name} {note}")
        self.reporter = None
        if cfg.mlflow_every_s:
            ctx = serve.get_replica_context()
            try:
                self.reporter = MlflowReporter(
                    self.engine, {**dataclasses.asdict(cfg), "note": note}, f"serve-{self.name}-{ctx.replica_tag}",
                    {"app": ctx.app_name, "deployment": ctx.deployment, "replica": ctx.replica_tag,
                     "version": str(ctx.code_version), "drafter": cfg.drafter or "default"},
                    every_s=cfg.mlflow_every_s)
            except Exception:  # noqa: BLE001 - an unreachable tracking store must not stop serving
                log.exception("no MLflow serving run: the tracking store failed")
        if old_reporter is not None:
            old_reporter.stop()
        if old is not None:
            old.shutdown()

    def __del__(self):  # Serve's replica shutdown
        if getattr(self, "reporter", None) is not None:
            self.reporter.stop()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    def health(self):
        return {"status": "ok", **self.engine.load()}

    @app.get("/v1/models")
    def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                            "owned_by": "flexdraft"}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ one request

    async def _generate(self, request: Request, chat: bool):
        t0 = time.perf_counter()  # (x-request-id: Serve's proxy honours the client's or makes one, and echoes it)
        try:
            self._authorize(request)
            try:
                body = await request.json()
            except ValueError:
                raise APIError(400, "the request body is not valid JSON") from None
            engine = self.engine.engine
            req = parse_request(body, chat, self.name, self.lm.tokenizer, engine.config.max_len,
                                self.cfg.default_max_tokens)
            fit_to_engine(req, engine)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        stream = self.engine.generate(req.prompt_ids, req.params)
        if req.stream:
            return StreamingResponse(self._events(req, stream, t0), media_type="text/event-stream")
        text, ids, t_first, last = TextStream(self.lm.tokenizer, req.stop), [], None, None
        out = []
        try:
            async for c in stream:
                t_first = t_first or time.perf_counter()
                ids += c.tokens
                out.append(text.add(c.tokens, final=c.finished is not None))
                last = c.finished
                if text.stopped:
                    break
        except FlexDraftError as e:
            return JSONResponse(APIError(400, str(e), "prompt").body(), status_code=400)
        except EngineFailed as e:
            return JSONResponse(APIError(500, str(e), kind="server_error").body(), status_code=500)
        finally:
            await stream.aclose()
        self.metrics.request_done(t0, t_first, len(ids))
        return JSONResponse(response(req, "".join(out), ids, last, text.stopped))

    async def _events(self, req, stream, t0: float):
        """Server-sent events: a chunk per engine step that made text, the last with its finish_reason, then usage
        (stream_options.include_usage) and `data: [DONE]`."""
        text, ids, t_first, first = TextStream(self.lm.tokenizer, req.stop), [], None, True
        last = None
        try:
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
        except (FlexDraftError, EngineFailed) as e:
            yield _sse(APIError(500, str(e), kind="server_error").body())
        finally:
            await stream.aclose()
        if req.include_usage:
            yield _sse(chunk(req, None) | {"usage": usage(req, len(ids)), "flexdraft": speculation(last)})
        self.metrics.request_done(t0, t_first, len(ids))
        yield "data: [DONE]\n\n"

    def _authorize(self, request: Request) -> None:
        key = os.environ.get(self.cfg.api_key_env)
        if not key:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", kind="authentication_error",
                           code="invalid_api_key")


def build_app(args: dict | None = None):
    """The app builder for `serve run serve.app:build_app` and config files (`import_path`). args: a ServeConfig
    as a dict (e.g. `serve run serve.app:build_app model=...` passes strings: use a config file for more)."""
    return FlexDraftServer.options(user_config=dict(args or {})).bind()
