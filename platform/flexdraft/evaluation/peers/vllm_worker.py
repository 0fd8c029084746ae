"""A vLLM offline engine serving the harness over stdin/stdout: run by the peer venv's Python, not ours (vLLM pins
other builds of transformers), so this file imports nothing of flexdraft.

    <peer venv>/bin/python vllm_worker.py '{"model": DIR, "dtype": "bfloat16", "speculative": null, "cpus": "0-1",
                                            "max_model_len": 1024, "max_num_seqs": 16, "enable_prefix_caching": false}'

It loads `vllm.LLM` once, prints {"ready": {"version": ...}} and then answers one JSON line per request line:
{"prompts": [[ids]], "batch": b, "max_new_tokens": n, "stop_token_ids": [...]} ->
{"outputs": [[ids]], "seconds": s, "tau": null, "acceptance_length": vLLM's mean acceptance length over its
steps that had drafts (1 + accepted / drafted steps), or null}: prompts in static batches of b (batch 1 is one
request at a time, as a client would send them), greedy; the time covers prefill and decoding, not loading.
"""
import json
import os
import sys
import time


def spec_counts(llm) -> tuple[float, float]:
    """vLLM's speculative-decoding counters so far: (verify steps that had drafts, accepted draft tokens)."""
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: 16 rows of 1,024 tokens need far less
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", spec["cpus"])
    # the engine core in this process: nothing else polls the cores between the harness's requests
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not mix with the protocol
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=spec.get("enable_prefix_caching", True),
              speculative_config=spec["speculative"], seed=0,
              disable_log_stats=False)  # (the stats hold the speculative counters)
    print(json.dumps({"ready": {"version": f"vLLM {vllm.__version__}"}}), file=out, flush=True)
    spent = spec_counts(llm)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                                stop_token_ids=req.get("stop_token_ids") or None)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        b = req["batch"]
        t0 = time.perf_counter()
        results = []
        for i in range(0, len(prompts), b):
            results += llm.generate(prompts[i:i + b], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        outputs = [list(r.outputs[0].token_ids) for r in results]
        drafts, accepted = spec_counts(llm)
        length = 1 + (accepted - spent[1]) / (drafts - spent[0]) if drafts > spent[0] else None
        spent = (drafts, accepted)
        print(json.dumps({"outputs": outputs, "seconds": seconds, "tau": None, "acceptance_length": length}),
              file=out, flush=True)


if __name__ == "__main__":
    main()
