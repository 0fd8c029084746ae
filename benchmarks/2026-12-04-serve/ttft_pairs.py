"""TTFT of a request sent right after another to the same app vs after one to the other app (the demo's two apps:
`serve deploy $FLEXDRAFT_HOME/demo/serve.yaml`, adaptive at /, AR at /ar).
    python ttft_pairs.py"""
import json
import statistics
import time

import httpx

from flexdraft.core.data import gsm8k_questions

if __name__ == "__main__":
    URL = "http://127.0.0.1:8000"
    qs = gsm8k_questions()[:16]
    res = {}
    def one(c, route, q):
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0, "stream": True}
        t0 = time.perf_counter(); ttft = None
        with c.stream("POST", f"{URL}{route}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and ttft is None and json.loads(line[6:]).get("choices"):
                    ttft = time.perf_counter() - t0
        return ttft * 1000
    with httpx.Client(timeout=120) as c:
        for i, q in enumerate(qs):
            seq = [("adaptive", ""), ("adaptive", ""), ("ar", "/ar"), ("ar", "/ar")] if i % 2 else \
                  [("ar", "/ar"), ("ar", "/ar"), ("adaptive", ""), ("adaptive", "")]
            for j, (name, route) in enumerate(seq):
                key = f"{name} after {'same' if j % 2 else 'other'} app"
                res.setdefault(key, []).append(one(c, route, q))
    for k, v in sorted(res.items()):
        print(f"{k:28s} TTFT p50 {statistics.median(v):6.1f} ms  mean {statistics.mean(v):6.1f}")
