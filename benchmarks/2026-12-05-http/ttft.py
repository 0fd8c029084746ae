"""Served TTFT at concurrency 1, split where it goes: learned at /, the same app with speculation off per request,
AR at /ar and AR again at /ar2 (the noise floor), one streamed request at a time, rotating (each round starts at
the next kind). Per request: the response's headers (the proxy, Serve's routing, validation and templating in the
replica) and the first token after them (the engine's prefill step, the chunk's way back).
    python ttft.py [N_PROMPTS] [MAX_TOKENS]     (the apps of ../2026-12-04-serve/apps.py: learned ar ar2)"""
import json
import statistics
import sys
import time

import httpx

from flexdraft.core.data import gsm8k_questions

if __name__ == "__main__":
    URL = "http://127.0.0.1:8000"
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    qs = gsm8k_questions()[:n]
    kinds = {"learned": ("", {}), "learned-spec-off": ("", {"flexdraft": {"speculation": False}}),
             "ar": ("/ar", {}), "ar2": ("/ar2", {})}


    def one(c: httpx.Client, route: str, extra: dict, q: str) -> tuple[float, float]:
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, **extra}
        t0 = time.perf_counter()
        with c.stream("POST", f"{URL}{route}/v1/chat/completions", json=body) as r:
            headers, ttft = time.perf_counter() - t0, None
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    ttft = time.perf_counter() - t0
        return headers * 1000, ttft * 1000


    with httpx.Client(timeout=120) as c:
        for route, extra in kinds.values():  # warm each path once
            one(c, route, extra, qs[0])
        res = {k: [] for k in kinds}
        for i, q in enumerate(qs):
            order = list(kinds)[i % len(kinds):] + list(kinds)[:i % len(kinds)]
            for k in order:
                res[k].append(one(c, *kinds[k], q))

    print(f"{n} GSM8K chat prompts, {max_tokens} tokens, one request at a time, rotating; ms")
    print("| kind | TTFT p50 | TTFT mean | headers mean | headers -> first token mean |")
    print("|---|---|---|---|---|")
    for k, v in res.items():
        h, t = [x[0] for x in v], [x[1] for x in v]
        print(f"| {k} | {statistics.median(t):.1f} | {statistics.mean(t):.1f} | {statistics.mean(h):.1f} | "
              f"{statistics.mean(t) - statistics.mean(h):.1f} |")
    print("per request TTFT:", json.dumps({k: [round(x[1]) for x in v] for k, v in res.items()}))
