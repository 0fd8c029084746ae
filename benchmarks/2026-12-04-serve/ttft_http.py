"""Served TTFT at concurrency 1: the adaptive app at /, the same app with speculation off per request, the AR app at
/ar (the demo's two apps: `serve deploy $FLEXDRAFT_HOME/demo/serve.yaml`), one request at a time, rotating.
    python ttft_http.py [N_PROMPTS]"""
import json
import statistics
import sys
import time

import httpx

from flexdraft.core.data import gsm8k_questions

if __name__ == "__main__":
    URL = "http://127.0.0.1:8000"
    qs = gsm8k_questions()[:int(sys.argv[1]) if len(sys.argv) > 1 else 12]
    kinds = {"adaptive": ("", {}), "adaptive-spec-off": ("", {"flexdraft": {"speculation": False}}), "ar": ("/ar", {})}
    res = {k: [] for k in kinds}
    with httpx.Client(timeout=120) as c:
        for i, q in enumerate(qs):
            order = list(kinds)[i % 3:] + list(kinds)[:i % 3]
            for k in order:
                route, extra = kinds[k]
                body = {"messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0, "stream": True, **extra}
                t0 = time.perf_counter(); ttft = None
                with c.stream("POST", f"{URL}{route}/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and ttft is None and json.loads(line[6:]).get("choices"):
                            ttft = time.perf_counter() - t0
                res[k].append(ttft * 1000)
    for k, v in res.items():
        print(f"{k:18s} TTFT p50 {statistics.median(v):6.1f} ms  mean {statistics.mean(v):6.1f}  {[round(x) for x in v]}")
