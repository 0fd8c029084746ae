"""`flexdraft loadtest --chaos`: hostile traffic against a FlexDraft endpoint on this machine, then a check that
the replica took no harm. Requests of seven classes, drawn from a seeded generator, at a few in flight:
valid (completions and chat, streamed or not), out_of_range (one field past what the engine takes), wrong_type,
malformed (not JSON, truncated, invalid UTF-8, NaN literals, deep nesting, lone surrogates), oversized (past
the body limit), disconnect (a client that leaves before the answer or mid-stream) and options (request options
combined as an attacker would, each judged: `chaos_options`). Then one client fills the batch with many-choice
requests while another's greedy request must get its first token within a budget. Before and after: a greedy
probe (its token ids must not change) and /health (rows, waiting requests, streams back to zero, no engine death,
the replica's RSS). Bounded in requests and time; loopback only."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from flexdraft.core import logs
from flexdraft.core.errors import FlexDraftError
from flexdraft.evaluation.chaos_options import attack_body, judge
from flexdraft.evaluation.loadtest import check_url

CLASSES = ("valid", "out_of_range", "wrong_type", "malformed", "oversized", "disconnect", "options")
PROBE = {"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
log = logs.get("loadtest")

OUT_OF_RANGE = [("max_tokens", 10 ** 7), ("max_tokens", 0), ("temperature", 5.0), ("temperature", -1),
                ("top_p", 0), ("top_p", 1.5), ("top_k", -7), ("seed", 2 ** 70), ("seed", -(2 ** 70)),
                ("prompt", [1, 10 ** 9]), ("prompt", [-1]), ("prompt", list(range(5000))), ("stop", ["x"] * 9),
                ("n", 4), ("logprobs", 5), ("model", "gpt-4o")]
WRONG_TYPE = [("max_tokens", "16"), ("max_tokens", 1.5), ("max_tokens", True), ("temperature", "hot"),
              ("temperature", [0.5]), ("top_p", [0.5]), ("seed", "42"), ("stream", "yes"), ("stop", 7),
              ("prompt", {"text": "hi"}), ("prompt", 42), ("prompt", [["a"]]), ("messages", "hi"),
              ("messages", [{"role": "user", "content": 5}]), ("stream_options", True), ("colour", "red")]
MALFORMED = [b"{", b"", b"null", b"[]", b'{"prompt": "hi", "max_tokens": 4', b"\xff\xfe\xfa not utf-8",
             b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
             b'{"prompt": "\\ud800\\udbff lone surrogates"}', b"[" * 100_000 + b"]" * 100_000,
             b'{"prompt": "hi", "prompt": 5}', b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 2}']


@dataclass
class ChaosReport:
    tried: Counter = field(default_factory=Counter)  # requests per class
    statuses: dict = field(default_factory=dict)  # class -> {status: count} (0: no response, "left": client left)
    server_errors: int = 0  # 5xx answers to requests the client did not leave
    hung: int = 0  # requests that got no answer within the timeout
    before: dict = field(default_factory=dict)  # /health
    after: dict = field(default_factory=dict)
    probe_unchanged: bool = False
    seconds: float = 0.0
    rss_budget_mb: float = 256.0  # how far the replica's RSS may grow over the run
    option_failures: list = field(default_factory=list)  # option attacks not answered as they must be, in words
    neighbour_ttft_s: float | None = None  # another client's first token while one client fills the batch
    ttft_budget_s: float = 10.0  # what it may take

    def as_dict(self) -> dict:
        b, a = self.before, self.after
        rss = (b.get("rss_mb"), a.get("rss_mb"))
        return {"tried": dict(self.tried), "statuses": self.statuses, "server_errors": self.server_errors,
                "hung": self.hung, "engine_deaths": int(not a.get("alive", False)) + int(b.get("replica") !=
                                                                                          a.get("replica")),
                "failed_steps": a.get("failed_steps", 0) - b.get("failed_steps", 0),
                "leaked": {k: a.get(k) for k in ("running", "waiting", "streams")},
                "rss_mb_before": rss[0], "rss_mb_after": rss[1], "probe_unchanged": self.probe_unchanged,
                "option_failures": self.option_failures, "neighbour_ttft_s": self.neighbour_ttft_s,
                "seconds": round(self.seconds, 1)}

    def problems(self) -> list[str]:
        """Everything that makes the run a failure, in words; none means the replica took no harm. A request the
        server must answer (class `valid`) got anything but 200; any request was dropped without an answer
        (a connection error), shed (503), answered 5xx or not at all; a step failed; the engine died; a row,
        waiting request or stream was left; the RSS grew past its budget; the probe decoded otherwise; or a
        class was never tried (the time ran out first)."""
        d = self.as_dict()
        untried = [c for c in CLASSES if not self.tried[c]]
        valid = {s: n for s, n in self.statuses.get("valid", {}).items()  # (5xx, 0 and errors: counted below)
                 if s.isdigit() and 0 < int(s) < 500 and s != "200"}
        dropped = sum(n for by in self.statuses.values() for s, n in by.items() if s.startswith("error:"))
        shed = sum(by.get("503", 0) for by in self.statuses.values())
        rss = (d["rss_mb_before"], d["rss_mb_after"])
        checks = [(untried, f"classes not tried: {', '.join(untried)}"),
                  (valid, f"valid requests answered {valid}"), (dropped, f"{dropped} dropped connection(s)"),
                  (shed, f"{shed} answer(s) 503"), (self.server_errors, f"{self.server_errors} 5xx answer(s)"),
                  (self.hung, f"{self.hung} request(s) unanswered"),
                  (d["failed_steps"], f"{d['failed_steps']} failed step(s)"),
                  (d["engine_deaths"], "the engine died or the replica was replaced"),
                  (any(d["leaked"].values()), f"left behind: {d['leaked']}"),
                  (None not in rss and rss[1] - rss[0] > self.rss_budget_mb,
                   f"RSS grew {rss[0]} -> {rss[1]} MB (budget {self.rss_budget_mb:g} MB)"),
                  (not self.probe_unchanged, "the greedy probe decoded otherwise"),
                  (self.option_failures, f"option attacks answered wrongly: {'; '.join(self.option_failures[:5])}"),
                  (self.neighbour_ttft_s is None or self.neighbour_ttft_s > self.ttft_budget_s,
                   f"another client's first token took {self.neighbour_ttft_s} s while one filled the batch "
                   f"(budget {self.ttft_budget_s:g} s)")]
        return [why for failed, why in checks if failed]

    def ok(self) -> bool:
        return not self.problems()


def valid_body(rng: random.Random, prompts: list[str]) -> tuple[str, dict]:
    """-> (route, body) of a request the server must answer with 200."""
    text = rng.choice(prompts)
    body = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0, 0.7, 1.0, 1e-300]),
            "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 0, 1, 40])
    if rng.random() < 0.3:
        body["seed"] = rng.randint(-(2 ** 63), 2 ** 63 - 1)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", [".", "!"]])
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


def hostile(kind: str, rng: random.Random, prompts: list[str], body_limit: int) -> tuple[str, bytes, float | None]:
    """-> (route, raw body, seconds after which the client leaves or None) of one request of class `kind`."""
    route, body = valid_body(rng, prompts)
    leave = None
    if kind == "out_of_range":
        key, value = rng.choice(OUT_OF_RANGE)
        body[key] = value
        if key == "prompt":
            route, body = "/v1/completions", {k: v for k, v in body.items() if k != "messages"} | {"prompt": value}
    elif kind == "wrong_type":
        key, value = rng.choice(WRONG_TYPE)
        body[key] = value
    elif kind == "malformed":
        return route, rng.choice(MALFORMED), None
    elif kind == "oversized":
        return route, json.dumps({"prompt": "x" * (body_limit + rng.randint(1, 4096))}).encode(), None
    elif kind == "disconnect":
        body["max_tokens"] = rng.randint(16, 64)
        leave = rng.choice([0.0, 0.01, 0.05, 0.2, 0.5])
    return route, json.dumps(body).encode(), leave


async def _send(client, url: str, raw: bytes, headers: dict, leave: float | None, timeout: float,
                body: list | None = None):
    """-> HTTP status, 0 for no answer within `timeout`, or "left" for a client that left on purpose. body: gets the
    answer's bytes appended."""
    async def go():
        async with client.stream("POST", url, content=raw, headers=headers) as r:
            async for block in r.aiter_raw():
                if body is not None:
                    body.append(block)
            return r.status_code

    try:
        if leave is not None:  # the client leaves after `leave` seconds, answered by then or not
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(go(), leave)
            return "left"
        return await asyncio.wait_for(go(), timeout)
    except TimeoutError:
        return 0
    except Exception as e:  # noqa: BLE001 - a dropped connection is an outcome to report
        return f"error:{type(e).__name__}"


async def _chaos(base: str, requests: int, concurrency: int, seed: int, headers: dict, timeout: float,
                 max_seconds: float, body_limit: int, prompts: list[str], rows: int, report: ChaosReport) -> None:
    import httpx

    rng = random.Random(seed)
    plan = [rng.choice(CLASSES) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    end = time.monotonic() + max_seconds

    async def one(client, kind: str, i: int):
        rng, attack, answer = random.Random(seed * 100_003 + i), None, []
        if kind == "options":
            route, body, attack = attack_body(rng, rng.choice(prompts), rows)
            raw, leave = json.dumps(body).encode(), None
        else:
            route, raw, leave = hostile(kind, rng, prompts, body_limit)
        async with gate:
            if time.monotonic() > end:
                return
            report.tried[kind] += 1
            status = await _send(client, base + route, raw, {**headers, "content-type": "application/json"},
                                 leave, timeout, answer)
        if attack is not None and isinstance(status, int) and status:
            wrong = judge(attack, body, status, b"".join(answer), too_big=len(raw) > body_limit)
            if wrong is not None:
                report.option_failures.append(f"{attack.name}: {wrong}")
        by_class = report.statuses.setdefault(kind, {})
        by_class[str(status)] = by_class.get(str(status), 0) + 1
        if status == 0:
            report.hung += 1
        elif isinstance(status, int) and status >= 500 and status != 503:  # (503s: counted as shed in problems())
            report.server_errors += 1

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        await asyncio.gather(*(one(client, kind, i) for i, kind in enumerate(plan)))


async def _neighbour(base: str, headers: dict, prompt: str, rows: int, timeout: float) -> float | None:
    """One client fills the batch of `rows` rows: four requests of a choice per row and a stream of as many choices
    with 20 top logprobs, long answers. Once requests wait for rows, another client's greedy request: seconds to its
    first token (None: no answer within `timeout`). The first client then leaves (its rows are freed)."""
    import httpx

    hog = {"prompt": prompt, "n": rows, "max_tokens": 512, "temperature": 1.0, "ignore_eos": True, "stream": True,
           "user": "hog"}
    chat = {k: v for k, v in hog.items() if k != "prompt"} | {
        "messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 20}
    mine = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True, "user": "neighbour"}

    async def stream(client, route: str, body: dict, first: list | None = None):
        async with client.stream("POST", base + route, json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if first is not None and line.startswith("data: {") and not first:
                    first.append(time.monotonic())

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=16)) as client:
        hogs = [asyncio.create_task(stream(client, "/v1/completions", hog)) for _ in range(4)]
        hogs.append(asyncio.create_task(stream(client, "/v1/chat/completions", chat)))
        try:
            end = time.monotonic() + timeout
            while time.monotonic() < end and not (await client.get(base + "/health", headers=headers)).json().get(
                    "waiting"):
                await asyncio.sleep(0.2)
            first: list = []
            t0 = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stream(client, "/v1/completions", mine, first), timeout)
            return round(first[0] - t0, 3) if first else None
        finally:
            for task in hogs:
                task.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)


def probe(base: str, headers: dict, timeout: float = 120) -> list[int]:
    import httpx

    r = httpx.post(f"{base}/v1/completions", json=PROBE, headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise FlexDraftError(f"the greedy probe got HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["token_ids"]


def health(base: str, headers: dict) -> dict:
    import httpx

    return httpx.get(f"{base}/health", headers=headers, timeout=30).json()


def settle(base: str, headers: dict, seconds: float = 30) -> dict:
    """/health once no row, waiting request or stream is left (or after `seconds`)."""
    end = time.monotonic() + seconds
    while True:
        state = health(base, headers)
        if not any(state.get(k) for k in ("running", "waiting", "streams")) or time.monotonic() > end:
            return state
        time.sleep(0.2)


def run_chaos(url: str, requests: int = 200, concurrency: int = 8, seed: int = 0, api_key: str | None = None,
              timeout: float = 120.0, max_seconds: float = 300.0, body_limit: int = 1 << 20,
              dataset: str = "gsm8k") -> ChaosReport:
    """Hostile traffic at `url` (this machine only) and the replica's state before and after (see the module)."""
    from flexdraft.evaluation.loadtest import prompts_of

    base = check_url(url)
    if requests < 1 or concurrency < 1 or max_seconds <= 0:
        raise FlexDraftError("requests and concurrency must be >= 1 and max_seconds > 0")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = ChaosReport()
    t0 = time.monotonic()
    before_ids = probe(base, headers)
    report.before = settle(base, headers)
    prompts, rows = prompts_of(dataset)[:64], report.before["max_batch"]
    asyncio.run(_chaos(base, requests, concurrency, seed, headers, timeout, max_seconds, body_limit, prompts, rows,
                       report))
    report.neighbour_ttft_s = asyncio.run(_neighbour(base, headers, prompts[0], rows, timeout))
    report.probe_unchanged = probe(base, headers) == before_ids
    report.after = settle(base, headers)
    report.seconds = time.monotonic() - t0
    return report


def summary(report: ChaosReport) -> str:
    d = report.as_dict()
    lines = ["| class | tried | statuses |", "|---|---|---|"]
    for kind in CLASSES:
        if report.tried[kind]:
            lines.append(f"| {kind} | {report.tried[kind]} | "
                         f"{', '.join(f'{s}: {n}' for s, n in sorted(report.statuses.get(kind, {}).items()))} |")
    lines.append(f"server errors (5xx except 503) {d['server_errors']}, hung {d['hung']}, engine deaths "
                 f"{d['engine_deaths']}, failed steps {d['failed_steps']}, leaked rows/waiting/streams "
                 f"{d['leaked']['running']}/{d['leaked']['waiting']}/{d['leaked']['streams']}, option attacks "
                 f"answered wrongly {len(report.option_failures)}, another client's first token in "
                 f"{report.neighbour_ttft_s} s while one filled the batch, RSS "
                 f"{d['rss_mb_before']} -> {d['rss_mb_after']} MB, greedy probe "
                 f"{'unchanged' if d['probe_unchanged'] else 'CHANGED'}, {d['seconds']} s: "
                 f"{'PASS' if report.ok() else 'FAIL: ' + '; '.join(report.problems())}")
    return "\n".join(lines)
