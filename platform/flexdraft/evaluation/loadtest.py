"""`flexdraft loadtest`: a real HTTP client (httpx, asyncio) against an OpenAI-compatible endpoint on this machine,
at a few concurrency levels, with dataset prompts sent as chat messages. Reports output tokens/s, TTFT, TPOT and
end-to-end latency (p50/p99), errors and the server-reported mean accepted length, as a table, a JSON file and
an MLflow run. Bounded in requests and time; loopback only."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from time import sleep

from flexdraft.core import logs
from flexdraft.core.data import BENCH_DATASETS
from flexdraft.core.errors import FlexDraftError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# seconds between one endpoint's turn and the next one's: a server may keep the shared cores busy after its last
# answer (vLLM's CPU worker ran at ~100% of a core for 1-1.5 s after 16 requests), which the next turn would pay for
PAUSE = 2.0
log = logs.get("loadtest")


@dataclass
class Outcome:
    status: int  # HTTP status (0: no response)
    seconds: float  # end to end
    ttft: float | None = None  # streamed requests only
    tokens: int = 0  # completion tokens (usage)
    accepted: float | None = None  # the server's mean accepted length for this request
    error: str = ""


def prompts_of(dataset: str, seed: int = 0) -> list[str]:
    """The dataset's first turns (each request stands alone) in the benchmark harness's seeded order: with the
    same seed, the first n requests of a single-turn set are the prompts `flexdraft bench` decodes."""
    name = {"mtbench": "mt-bench"}.get(dataset, dataset)
    if name not in BENCH_DATASETS:
        raise FlexDraftError(f"unknown dataset {dataset!r}: use one of {', '.join(BENCH_DATASETS)}")
    items = BENCH_DATASETS[name].items()
    return [items[i][0] for i in random.Random(seed).sample(range(len(items)), len(items))]


async def _one(client, url: str, payload: dict, headers: dict) -> Outcome:
    t0 = time.perf_counter()
    try:
        if not payload["stream"]:
            r = await client.post(url, json=payload, headers=headers)
            body = r.json()
            if r.status_code != 200:
                return Outcome(r.status_code, time.perf_counter() - t0, error=body.get("error", {}).get("message", ""))
            return Outcome(200, time.perf_counter() - t0, tokens=body["usage"]["completion_tokens"],
                           accepted=body.get("flexdraft", {}).get("mean_accepted_length"))
        out = Outcome(0, 0.0)
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode()[:300]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = event["error"].get("message", "stream error")
                    if event.get("choices") and out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                    if event.get("usage"):
                        out.tokens = event["usage"]["completion_tokens"]
                        out.accepted = event.get("flexdraft", {}).get("mean_accepted_length")
        out.seconds = time.perf_counter() - t0
        return out
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not the end of the test
        return Outcome(0, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


async def send_level(base: str, prompts: list[str], concurrency: int, first: int, requests: int, stream: bool,
                     max_tokens: int, headers: dict, timeout: float, model: str | None) -> tuple[list[Outcome], float]:
    """Requests first .. first + requests - 1 (prompts in turn), at most `concurrency` in flight."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def send(client, i: int) -> Outcome:
        payload = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
                   "temperature": 0, "stream": stream}
        if stream:
            payload["stream_options"] = {"include_usage": True}
        if model:
            payload["model"] = model
        async with gate:
            return await _one(client, f"{base}/v1/chat/completions", payload, headers)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(send(client, i) for i in range(first, first + requests)))
        return list(outcomes), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.status == 200 and not o.error]
    tokens = sum(o.tokens for o in ok)
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tpot = [(o.seconds - o.ttft) / (o.tokens - 1) for o in ok if o.ttft is not None and o.tokens > 1]
    e2e = [o.seconds for o in ok]
    accepted = [o.accepted for o in ok if o.accepted is not None]
    return {"requests": len(outcomes), "errors": len(outcomes) - len(ok), "output_tokens": tokens,
            "tokens_per_s": tokens / wall if wall else 0.0, "wall_s": wall,
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99), "tpot_p50": _pct(tpot, 0.5),
            "tpot_p99": _pct(tpot, 0.99), "e2e_p50": _pct(e2e, 0.5), "e2e_p99": _pct(e2e, 0.99),
            "mean_accepted_length": statistics.fmean(accepted) if accepted else None,
            "error_samples": sorted({o.error or f"HTTP {o.status}" for o in outcomes if o not in ok})[:3]}


def endpoints_of(r: dict) -> list[tuple[str, dict]]:
    """A level's results by endpoint: the one under test ("target"), then the baseline and the compared ones."""
    return [("target", r), *([("baseline", r["baseline"])] if "baseline" in r else []), *r.get("compare", {}).items()]


def table(results: dict[int, dict]) -> str:
    """A row per concurrency level and endpoint: the one under test, then the baseline and the compared ones, each
    with its tok/s ratio to the baseline."""
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f}"
    lines = ["| concurrency | endpoint | tok/s | speed-up | TTFT p50/p99 ms | TPOT p50/p99 ms | e2e p50/p99 ms | "
             "errors | accepted len |", "|---|---|---|---|---|---|---|---|---|"]
    for c, r in results.items():
        for name, x in endpoints_of(r):
            ratio = f"{x['speedup']:.2f}x" if "speedup" in x else "1.00x" if name == "baseline" else "-"
            acc = "-" if x["mean_accepted_length"] is None else f"{x['mean_accepted_length']:.2f}"
            lines.append(f"| {c} | {name} | {x['tokens_per_s']:.1f} | {ratio} | "
                         f"{ms(x['ttft_p50'])}/{ms(x['ttft_p99'])} | {ms(x['tpot_p50'])}/{ms(x['tpot_p99'])} | "
                         f"{ms(x['e2e_p50'])}/{ms(x['e2e_p99'])} | "
                         f"{x['errors']}/{x['requests']} | {acc} |")
    return "\n".join(lines)


def check_url(url: str) -> str:
    """-> the endpoint's base (without /v1); refuses anything but this machine."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in LOOPBACK:
        raise FlexDraftError(f"loadtest sends to this machine only (127.0.0.1 / localhost), got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def rounds(requests: int, concurrency: int) -> list[tuple[int, int]]:
    """A level's requests as (first, count) rounds for a side-by-side run: up to 4, each at least twice the
    concurrency, so the endpoints take turns often enough that a machine whose speed drifts (other tenants, CPU
    steal) slows them alike."""
    n = max(1, min(4, requests // (2 * concurrency)))
    bounds = [round(i * requests / n) for i in range(n + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def run_loadtest(url: str, dataset: str, concurrency: list[int], requests: int, stream: bool = True,
                 api_key: str | None = None, max_tokens: int = 64, timeout: float = 300.0,
                 output: str | Path | None = None, model: str | None = None,
                 baseline: str | None = None, compare: dict[str, str] | None = None,
                 pause: float = PAUSE) -> dict[int, dict]:
    """Each concurrency level in turn, `requests` requests each (the same prompts in the same order). baseline: a
    second endpoint (e.g. the same deployment with `mode: ar`); compare: more endpoints by name (e.g. another
    policy, or a second AR app as the noise floor). With either, every endpoint is sent the same requests at every
    level, taking turns in rounds (`rounds`; round k starts at the k-th endpoint, so none always goes first), each
    turn `pause` seconds after the one before; each level's result then holds `baseline` and `compare` {name:
    result}, and each of those and the target has `speedup`, its tok/s over the baseline's."""
    base = check_url(url)
    endpoints = {"target": base}
    if compare and ({"target", "baseline"} & compare.keys()):
        raise FlexDraftError("'target' and 'baseline' name --url and --baseline: name compared endpoints otherwise")
    for name, u in (({"baseline": baseline} if baseline else {}) | (compare or {})).items():
        checked = check_url(u)
        if checked in endpoints.values():
            raise FlexDraftError(f"{name} ({u}) is an endpoint already measured (the one under test is {url}): "
                                 "each endpoint once, e.g. the app in mode ar as the baseline")
        endpoints[name] = checked
    if requests < 1 or not concurrency or min(concurrency) < 1 or max_tokens < 1:
        raise FlexDraftError("requests, every concurrency and max_tokens must be >= 1")
    prompts = prompts_of(dataset)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run = lambda endpoint, c, first, n: asyncio.run(send_level(endpoint, prompts, c, first, n, stream, max_tokens,
                                                           headers, timeout, model))
    names = list(endpoints)
    results, turns = {}, 0
    for c in concurrency:
        got = {name: ([], 0.0) for name in names}
        for k, (first, n) in enumerate(rounds(requests, c) if len(names) > 1 else [(0, requests)]):
            for name in names[k % len(names):] + names[:k % len(names)]:
                if turns and len(names) > 1:
                    sleep(pause)
                turns += 1
                outcomes, wall = run(endpoints[name], c, first, n)
                got[name] = (got[name][0] + outcomes, got[name][1] + wall)
        summary = {name: summarize(*got[name]) for name in names}
        results[c] = r = summary.pop("target")
        if baseline:
            r["baseline"] = b = summary.pop("baseline")
            for x in [r, *summary.values()]:
                x["speedup"] = x["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else 0.0
        if summary:
            r["compare"] = summary
        log.info(f"concurrency {c}: " + "; ".join(
            f"{name} {x['tokens_per_s']:.1f} tok/s, {x['errors']} errors"
            + (f" ({x['speedup']:.2f}x)" if "speedup" in x else "")
            for name, x in endpoints_of(r)))
    print(table(results))
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"url": url, "baseline": baseline, "compare": compare or {}, "dataset": dataset,
                                    "stream": stream, "max_tokens": max_tokens, "results": results}, indent=1))
        log.info(f"results in {path}")
    _track({"url": url, "baseline": baseline or "", "dataset": dataset, "stream": stream, "max_tokens": max_tokens,
            "requests_per_level": requests, **{f"compare/{k}": v for k, v in (compare or {}).items()}}, results,
           served_card(base, headers))
    return results


def served_card(base: str, headers: dict) -> dict[str, str]:
    """What the endpoint says it serves (`/v1/models`' `flexdraft` field: app, deployment, drafter and its
    registered version, policy); {} from a server that does not say."""
    import httpx

    try:
        data = httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"][0]
        return {k: str(v) for k, v in (data.get("flexdraft") or {}).items()}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return {}


def _track(params: dict, results: dict, card: dict[str, str]) -> None:
    """An MLflow run in `flexdraft-loadtest`: each level's numbers at step = concurrency (baseline/ and each compared
    endpoint's name/ prefixed), tagged with what the target serves (`served_card`). Against a registered drafter
    the speed-ups are also linked to its LoggedModel and summarised in tags on its version."""
    import mlflow

    from flexdraft.core.tracking import start_run
    from flexdraft.drafter.registry import set_tags

    numbers = lambda r, prefix="": {prefix + k: v for k, v in r.items() if isinstance(v, (int, float))}
    model_id = card.get("drafter_model_id")
    with start_run("flexdraft-loadtest", params, run_name=f"loadtest-{params['dataset']}") as run:
        mlflow.set_tags({f"flexdraft.{k}": v for k, v in card.items()})
        for c, r in results.items():
            mlflow.log_metrics({k: v for name, x in endpoints_of(r)
                                for k, v in numbers(x, "" if name == "target" else f"{name}/").items()}, step=c)
            if model_id and "speedup" in r:
                mlflow.log_metrics({"loadtest/speedup": r["speedup"], "loadtest/tokens_per_s": r["tokens_per_s"]},
                                   step=c, model_id=model_id)
    if card.get("drafter_version"):
        speedups = ", ".join(f"c{c} {r['speedup']:.2f}x" for c, r in results.items() if "speedup" in r)
        try:
            set_tags(card["drafter_version"], {
                "loadtest.last_run": run.info.run_id, "loadtest.dataset": params["dataset"],
                "loadtest.deployment": f"{card.get('app', '?')}/{card.get('deployment', '?')}",
                **({"loadtest.speedup": speedups} if speedups else {})})
        except FlexDraftError as e:  # e.g. the server's registry is another store than this client's
            log.warning(f"the load test is not linked to {card['drafter_version']}: {e}")
