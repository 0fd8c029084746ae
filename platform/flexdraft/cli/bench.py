"""`flexdraft bench` (the harness), `bench-ar` (our AR vs transformers) and `loadtest` (an endpoint under load or chaos)."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from flexdraft.cli.flags import add_console_flags
from flexdraft.core.errors import FlexDraftError
from flexdraft.evaluation.peers import PEER_GROUPS

FULL_BENCH_CONFIG = "configs/bench/full.yaml"

def cmd_bench_ar(args) -> None:
    from flexdraft.evaluation.bench import ArBenchConfig, run_ar_benchmark

    cfg = ArBenchConfig(model=args.model, device=args.device, batch_sizes=args.batch_sizes, dtypes=args.dtypes,
                        threads=args.threads_list, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    run_ar_benchmark(cfg)


def cmd_bench(args) -> None:
    from flexdraft.evaluation.harness import HarnessConfig, load_harness_config, run_harness

    if args.full and args.config:
        raise FlexDraftError("give --config FILE or --full, not both")
    path = FULL_BENCH_CONFIG if args.full else args.config
    cfg = load_harness_config(path) if path else HarnessConfig()
    for key in ("drafter", "store", "device", "dtype", "output_dir", "temperature", "top_p"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    cfg.params()  # an overridden temperature / top-p checked before any work
    if args.peers:
        added = [m for g in args.peers for m in PEER_GROUPS[g] if m not in cfg.methods]
        cfg = HarnessConfig(**{**asdict(cfg), "methods": cfg.methods + added})  # checked again, peers' venv too
    run_harness(cfg)


def cmd_loadtest(args) -> None:
    import os
    import time

    from flexdraft.core.config import data_dir
    from flexdraft.evaluation.loadtest import PAUSE, run_loadtest

    api_key = args.api_key or os.environ.get("FLEXDRAFT_API_KEY")
    if args.chaos:
        from flexdraft.evaluation.chaos import run_chaos, summary

        report = run_chaos(args.url, args.requests, max(args.concurrency), args.seed, api_key,
                           max_seconds=args.max_seconds, body_limit=args.body_limit, dataset=args.dataset)
        print(summary(report))
        output = Path(args.output or data_dir() / "loadtest" / f"chaos-{int(time.time())}.json")
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report.as_dict(), indent=1))
        print(f"[chaos] report in {output}", file=sys.stderr)
        if not report.ok():
            raise FlexDraftError("the endpoint did not hold under chaos (see the table above)")
        return
    compare = {}
    for item in args.compare:
        name, sep, url = item.partition("=")
        if not sep or not name or not url or name in compare:
            raise FlexDraftError(f"--compare takes distinct NAME=URL pairs, got {item!r}")
        compare[name] = url
    output = args.output or data_dir() / "loadtest" / f"{args.dataset}-{int(time.time())}.json"
    run_loadtest(args.url, args.dataset, args.concurrency, args.requests, stream=args.stream,
                 api_key=api_key, max_tokens=args.max_tokens,
                 output=output, model=args.model, baseline=args.baseline, compare=compare,
                 pause=PAUSE if args.pause is None else args.pause)


def register(sub) -> None:
    b = sub.add_parser("bench-ar", help="our AR generation vs transformers generate, side by side")
    b.add_argument("--model", default="smollm2")
    b.add_argument("--device", default="auto")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    b.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    b.add_argument("--threads", dest="threads_list", type=int, nargs="+", default=[0], help="0 = one per core")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.set_defaults(func=cmd_bench_ar)
    b = sub.add_parser("bench", help="datasets x batch sizes x methods (baselines, FlexDraft modes, ablations)")
    b.add_argument("--config", help="harness YAML (default: the embedded defaults, configs/bench/default.yaml)")
    b.add_argument("--full", action="store_true", help=f"the bigger run of {FULL_BENCH_CONFIG}")
    b.add_argument("--drafter", help="drafter folder, models:/NAME/VERSION or models:/NAME@ALIAS (MLflow registry), or 'init' (untrained) (default: the config's, else the default pipeline's)")
    b.add_argument("--store", help="n-gram store: a file, a distill folder or 'none' (default: the config's)")
    b.add_argument("--device", help="override the config's device")
    b.add_argument("--dtype", help="override the config's dtype")
    b.add_argument("--output-dir", help="where results.md/json and plots go (default $FLEXDRAFT_HOME/bench/<time>)")
    b.add_argument("--temperature", type=float, help="sample at this temperature (default: the config's, greedy)")
    b.add_argument("--top-p", type=float, help="nucleus sampling with --temperature")
    b.add_argument("--peers", nargs="+", choices=sorted(PEER_GROUPS), default=[],
                   help="also run the stacks a user would run instead, on the same weights, prompts, dtype and cores: "
                   "vllm = vLLM for CPU, plain and with n-gram speculation (its own venv: `make peer-vllm`); llama.cpp = "
                   "llama.cpp through llama-cpp-python on the model's GGUF (`make peer-llama`)")
    add_console_flags(b)
    b.set_defaults(func=cmd_bench)
    lt = sub.add_parser("loadtest", help="concurrent OpenAI-API requests against a local endpoint: tok/s, latencies")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint (this machine only)")
    lt.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval, mtbench or sharegpt-long "
                    "(first turns, as chat)")
    lt.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    lt.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--stream", action="store_true", help="stream (measures time to first token)")
    lt.add_argument("--api-key", help="bearer key (default: $FLEXDRAFT_API_KEY)")
    lt.add_argument("--model", help="the served model name to send (default: the server's)")
    lt.add_argument("--baseline", metavar="URL", help="a second endpoint measured beside --url at every level (e.g. "
                    "the same app with mode ar): tok/s ratio per level")
    lt.add_argument("--compare", nargs="+", metavar="NAME=URL", default=[], help="more endpoints measured in the same "
                    "rounds (e.g. static=http://127.0.0.1:8000/static ar2=http://127.0.0.1:8000/ar2 for a noise "
                    "floor), each with its tok/s ratio to --baseline")
    lt.add_argument("--pause", type=float, help="seconds between one endpoint's turn and the next's, so each "
                    "starts on quiet cores (default: loadtest.PAUSE, 2)")
    lt.add_argument("--output", help="results JSON (default: $FLEXDRAFT_HOME/loadtest/<dataset>-<time>.json)")
    lt.add_argument("--chaos", action="store_true", help="hostile traffic instead (out-of-range, wrong types, "
                    "malformed and oversized bodies, clients that leave): --requests of them at the largest "
                    "--concurrency; checks the replica is unharmed (exit 2 if not)")
    lt.add_argument("--seed", type=int, default=0, help="--chaos: the seed of its request mix")
    lt.add_argument("--max-seconds", type=float, default=300, help="--chaos: stop sending after this long")
    lt.add_argument("--body-limit", type=int, default=1 << 20, help="--chaos: the server's max_body_bytes")
    add_console_flags(lt)
    lt.set_defaults(func=cmd_loadtest)
