"""`flexdraft` command line: generate, bench, bench-ar, the pipeline stages, demo, env."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexdraft.core import logs
from flexdraft.core.errors import FlexDraftError

REPO = Path(__file__).resolve().parents[3]
FULL_BENCH_CONFIG = str(REPO / "configs" / "bench" / "full.yaml")
SERVE_CONFIG = REPO / "serve" / "config.yaml"


def _runtime(args):
    from flexdraft.core.config import RuntimeConfig

    return RuntimeConfig(device=args.device, dtype=args.dtype, threads=args.threads)


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled), a .gguf file or a HF folder")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (GPU only)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (default 0: one per core)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields that are flags, with the config's defaults and help: one place for both."""
    import dataclasses

    from flexdraft.engine.config import MODES, EngineConfig

    p.add_argument("--mode", choices=MODES,
                   help="decoding mode (default: adaptive when a drafter is available, else ar)")
    for f in dataclasses.fields(EngineConfig):
        if "help" in f.metadata:
            p.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
                           default=f.default, help=f"{f.metadata['help']} (default {f.default})")


def _engine_config(args):
    import dataclasses

    from flexdraft.engine.config import EngineConfig

    knobs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    return EngineConfig(mode=args.mode or "adaptive", **knobs)


def cmd_generate(args) -> None:
    from flexdraft.core.data import chat_ids, read_prompts_file, text_ids
    from flexdraft.speculative.sampling import SamplingParams
    from flexdraft.engine.ar import check_prompts
    from flexdraft.engine.runner import load_engine

    if (args.prompt is None) == (args.prompts_file is None):
        raise FlexDraftError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
    if args.max_batch < 1:
        raise FlexDraftError(f"--batch-size must be >= 1, got {args.max_batch}")
    sampling_flag = args.temperature is not None or args.top_p is not None or args.top_k is not None
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=(args.temperature if args.temperature is not None else (1.0 if sampling_flag else 0.0)),
        top_k=args.top_k or 0,
        top_p=args.top_p if args.top_p is not None else 1.0,
        seed=args.seed,
    )
    if args.policy and args.mode:
        raise FlexDraftError("--policy sets the mode per live batch size: drop --mode")
    cfg = _engine_config(args)
    lm, engine, note = load_engine(args.model, _runtime(args), args.drafter, cfg, mode_given=args.mode is not None,
                                   store_spec=args.store, policy_spec=args.policy)
    tok = lm.tokenizer
    if args.prompt is not None:
        prompts = [chat_ids(tok, [{"role": "user", "content": args.prompt}]) if args.chat
                   else text_ids(tok, args.prompt)]
    else:
        prompts = read_prompts_file(args.prompts_file, tok)
    check_prompts(prompts, lm.model.args.max_position_embeddings, lm.model.args.vocab_size)  # all, up front
    for i, p in enumerate(prompts):  # the engine's own check, naming the prompt too
        try:
            engine.check_request(p, params)
        except FlexDraftError as e:
            raise FlexDraftError(f"prompt {i}: {e} (--max-len)") from None
    print(note, file=sys.stderr)
    gens = engine.generate(prompts, params)
    total_tokens = sum(len(g.token_ids) for g in gens)
    total_time = sum(g.seconds for g in gens)
    for i, g in enumerate(gens):
        text = tok.decode(g.token_ids, skip_special_tokens=True)
        if args.json:
            row = {"index": i, "token_ids": g.token_ids, "text": text, "seconds": round(g.seconds, 6),
                   "finish_reason": g.finish_reason, "prompt_tokens": g.prompt_len, "mode": cfg.mode}
            if cfg.mode != "ar":
                row.update(accepted_lengths=g.extra["accepted_lengths"], tau=round(g.extra["tau"], 4))
            print(json.dumps(row), flush=True)
        else:
            print(text, flush=True)
            if len(prompts) > 1:
                print("-" * 40, flush=True)
    taus = [g.extra["tau"] for g in gens]
    print(f"[{len(prompts)} prompts, {total_tokens} tokens in {total_time:.2f}s: "
          f"{total_tokens / max(total_time, 1e-9):.1f} tokens/s, mode {cfg.mode}, "
          f"tau {sum(taus) / len(taus):.2f}]", file=sys.stderr)


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
    run_harness(cfg)


def cmd_demo(args) -> None:
    from flexdraft.cli.demo import run_demo
    from flexdraft.evaluation.harness import load_harness_config
    from flexdraft.drafter.recipe import load_pipeline_config

    run_demo(load_pipeline_config(args.config) if args.config else None,
             load_harness_config(args.bench_config) if args.bench_config else None)


def cmd_job(args) -> None:
    """The Ray jobs of jobs/*.py, on a local Ray instance or the cluster in RAY_ADDRESS."""
    from flexdraft.training.jobs import run_stage
    from flexdraft.drafter.recipe import load_pipeline_config

    run_stage(load_pipeline_config(args.config), args.stage)


VERSIONS = ("flexdraft", "torch", "ray", "deepspeed", "transformers", "mlflow", "datasets", "safetensors")
ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "FLEXDRAFT_HOME")


def env_report(model: str) -> dict:
    """What the hardware probe found, what each `auto` resolves to here, versions and the relevant env vars."""
    import importlib.metadata
    import json as json_
    import os
    import platform

    import torch

    from flexdraft.core.config import RuntimeConfig, data_dir
    from flexdraft.core.hardware import probe
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import BUNDLED, bundled_gguf, gguf_cache_folder
    from flexdraft.models.transformer import cpu_attention_kernel

    caps, runtime = probe(), RuntimeConfig()
    runtime.apply()
    device, dtype = runtime.torch_device(), runtime.torch_dtype()
    attention = "sdpa"  # CUDA and fp32 on CPU; bf16 on CPU: whichever of sdpa / math a micro-benchmark finds faster
    if device.type == "cpu" and dtype != torch.float32:
        folder = gguf_cache_folder(bundled_gguf()) if model == BUNDLED else Path(model).expanduser()
        if (folder / "config.json").is_file():
            args = ModelArgs.from_hf_config(json_.loads((folder / "config.json").read_text()))
            attention = f"{cpu_attention_kernel(args, dtype)} (timed for {model})"
        else:
            attention = f"sdpa or math, timed when {model} first loads"
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "platform": f"{platform.platform()}, Python {platform.python_version()}",
        "hardware": {**caps.describe(), "cores_available": str(len(os.sched_getaffinity(0)))},
        "auto": {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
                 "prepack": str(device.type == "cpu" and caps.can_prepack(dtype)), "attention": attention,
                 "threads": str(torch.get_num_threads())},
        "versions": versions,
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "data_dir": str(data_dir()),
    }


def cmd_cluster(args) -> None:
    """A multi-node Ray cluster and an MLflow server on this machine (infra/local/cluster.yaml)."""
    from flexdraft.cluster import local as cluster

    cfg = cluster.load_cluster_config(args.config)
    if args.action == "up":
        cluster.up(cfg, say=lambda m: print(m, file=sys.stderr, flush=True))
        print(cluster.format_status(cluster.status(cfg)))
    elif args.action == "down":
        cluster.down(cfg, args.node or None, force=args.force, say=lambda m: print(m, file=sys.stderr, flush=True))
    elif args.action == "status":
        st = cluster.status(cfg)
        print(json.dumps(st, indent=2) if args.json else cluster.format_status(st))
    else:
        print("\n".join(f"export {k}={v}" for k, v in cluster.client_env(cfg).items()))


def cmd_sweep(args) -> None:
    """tuning/sweep.py of this checkout, as its own process (Ray Tune ships its trial functions from there)."""
    import subprocess

    argv = ["--config", args.config] + (["--drafter", args.drafter] if args.drafter else []) + \
        (["--resume"] if args.resume else [])
    rc = subprocess.call([sys.executable, str(REPO / "tuning" / "sweep.py"), *argv])
    if rc:
        sys.exit(rc)


def cmd_env(args) -> None:
    report = env_report(args.model)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"flexdraft env ({report['platform']})")
    for section in ("hardware", "auto", "versions", "env"):
        print({"hardware": "hardware (probed)", "auto": "auto resolves to", "versions": "versions",
               "env": "environment"}[section])
        for k, v in report[section].items():
            print(f"  {k:<20} {v}")
        if not report[section]:
            print("  (none set)")
    print(f"data dir  {report['data_dir']}")


def cmd_serve(args) -> None:
    """`serve run` of serve/config.yaml with the given overrides (checked before Ray starts); runs until Ctrl-C."""
    import os
    import shutil

    import yaml

    from flexdraft.core.config import data_dir, from_dict
    from flexdraft.serving.config import ServeConfig, check_exposure

    cfg = yaml.safe_load(Path(args.config).read_text())
    app = cfg["applications"][0]
    app.setdefault("runtime_env", {})["working_dir"] = f"local://{REPO}"  # this checkout, on this machine
    env_vars = app["runtime_env"].setdefault("env_vars", {})
    user = app["deployments"][0].setdefault("user_config", {})
    key_env = user.get("api_key_env", "FLEXDRAFT_API_KEY")
    # replicas on a cluster's nodes log, read and authenticate as this shell
    for key in ("MLFLOW_TRACKING_URI", "FLEXDRAFT_HOME", key_env):
        if key in os.environ:
            env_vars.setdefault(key, os.environ[key])
    if args.insecure:
        user["insecure"] = True
    for key in ("model", "drafter", "store"):
        if getattr(args, key) is not None:
            user[key] = getattr(args, key)
    if args.mode:
        user.setdefault("engine", {})["mode"] = args.mode
    if args.num_cpus is not None:  # e.g. 1 on a cluster of 1-CPU nodes (a replica larger than every node never starts)
        app["deployments"][0].setdefault("ray_actor_options", {})["num_cpus"] = args.num_cpus
    check_exposure(from_dict(ServeConfig, user), args.host, {**os.environ, **env_vars})  # fail closed, before Ray
    cfg.setdefault("http_options", {}).update(host=args.host, port=args.port)
    path = data_dir() / "serve" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve_bin is None:
        raise FlexDraftError("the `serve` command of Ray Serve is not installed (pip install 'ray[serve]')")
    print(f"[serve] OpenAI-compatible API at http://{args.host}:{args.port}/v1 once the replica is up "
          f"(config {path}); Ctrl-C stops it", file=sys.stderr, flush=True)
    os.execv(serve_bin, [serve_bin, "run", str(path)])


def cmd_loadtest(args) -> None:
    import os
    import time

    from flexdraft.core.config import data_dir
    from flexdraft.evaluation.loadtest import run_loadtest

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
    output = args.output or data_dir() / "loadtest" / f"{args.dataset}-{int(time.time())}.json"
    run_loadtest(args.url, args.dataset, args.concurrency, args.requests, stream=args.stream,
                 api_key=api_key, max_tokens=args.max_tokens,
                 output=output, model=args.model, baseline=args.baseline)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with the target model")
    _add_runtime_flags(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    g.add_argument("--prompts-file", help="JSONL: {prompt} | {messages} | {prompt_token_ids} per line")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--drafter", help="drafter folder, or 'init' (untrained); default: the default pipeline's")
    g.add_argument("--policy", help="a policy file from `flexdraft sweep` (mode, B', pruning per live batch size, "
                                    "and S; it overrides those flags); refused for another model or drafter")
    g.add_argument("--store", help="n-gram store for lookup steps: a store file, a distill folder, or 'none' "
                                   "(default: the default pipeline's distilled data, when it exists)")
    _add_engine_flags(g)
    g.add_argument("--json", action="store_true", help="one JSON line per prompt, in input order")
    g.set_defaults(func=cmd_generate)

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
    b.add_argument("--drafter", help="drafter folder or 'init' (default: the config's, else the default pipeline's)")
    b.add_argument("--store", help="n-gram store: a file, a distill folder or 'none' (default: the config's)")
    b.add_argument("--device", help="override the config's device")
    b.add_argument("--dtype", help="override the config's dtype")
    b.add_argument("--output-dir", help="where results.md/json and plots go (default $FLEXDRAFT_HOME/bench/<time>)")
    b.add_argument("--temperature", type=float, help="sample at this temperature (default: the config's, greedy)")
    b.add_argument("--top-p", type=float, help="nucleus sampling with --temperature")
    b.set_defaults(func=cmd_bench)

    for name, stage, help_ in [("distill", "distill", "self-distillation data (Ray actors)"),
                               ("tune-attention", "attention", "attention tuning (Ray Train + DeepSpeed)"),
                               ("calibrate", "calibration", "calibration MLP (Ray Train + DeepSpeed)"),
                               ("pipeline", "pipeline", "distill, then attention tuning, then calibration")]:
        j = sub.add_parser(name, help=help_)
        j.add_argument("--config", default="configs/smollm2.yaml", help="pipeline YAML")
        j.set_defaults(func=cmd_job, stage=stage)

    w = sub.add_parser("sweep", help="Ray Tune sweep of decode-time or training-time settings -> a policy file")
    w.add_argument("--config", default=str(REPO / "tuning" / "configs" / "decode.yaml"), help="sweep YAML")
    w.add_argument("--drafter", help="decode sweeps: the drafter to sweep over (default: the config's)")
    w.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this name")
    w.set_defaults(func=cmd_sweep)

    c = sub.add_parser("cluster", help="a multi-node Ray cluster and an MLflow tracking server on this machine")
    c.add_argument("action", choices=("up", "down", "status", "env"),
                   help="up: start what is not running; down: end what up started; env: the client's exports")
    c.add_argument("--config", default=str(REPO / "infra" / "local" / "cluster.yaml"), help="cluster YAML")
    c.add_argument("--node", action="append", help="down: only this node (or mlflow); repeatable")
    c.add_argument("--force", action="store_true", help="down: SIGKILL at once, as a machine failure would")
    c.add_argument("--json", action="store_true", help="status as JSON")
    c.set_defaults(func=cmd_cluster)

    e = sub.add_parser("env", help="what this machine can run fast and what `auto` resolves to (for bug reports)")
    e.add_argument("--model", default="smollm2", help="the model whose attention kernel choice to show")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_env)

    s = sub.add_parser("serve", help="the OpenAI-compatible Ray Serve app (serve run serve/config.yaml)")
    s.add_argument("--config", default=str(SERVE_CONFIG), help="Serve config file")
    s.add_argument("--model", help="override user_config.model")
    s.add_argument("--drafter", help="override user_config.drafter (a folder, 'init', '' = the default pipeline's)")
    s.add_argument("--store", help="override user_config.store")
    s.add_argument("--mode", help="override user_config.engine.mode")
    s.add_argument("--num-cpus", type=float, help="override each replica's ray_actor_options.num_cpus (its threads)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key "
                   "($FLEXDRAFT_API_KEY); refused otherwise")
    s.set_defaults(func=cmd_serve)

    lt = sub.add_parser("loadtest", help="concurrent OpenAI-API requests against a local endpoint: tok/s, latencies")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint (this machine only)")
    lt.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval or mtbench (first turns, as chat)")
    lt.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    lt.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--stream", action="store_true", help="stream (measures time to first token)")
    lt.add_argument("--api-key", help="bearer key (default: $FLEXDRAFT_API_KEY)")
    lt.add_argument("--model", help="the served model name to send (default: the server's)")
    lt.add_argument("--baseline", metavar="URL", help="a second endpoint measured beside --url at every level (e.g. "
                    "the same app with mode ar): tok/s ratio per level")
    lt.add_argument("--output", help="results JSON (default: $FLEXDRAFT_HOME/loadtest/<dataset>-<time>.json)")
    lt.add_argument("--chaos", action="store_true", help="hostile traffic instead (out-of-range, wrong types, "
                    "malformed and oversized bodies, clients that leave): --requests of them at the largest "
                    "--concurrency; checks the replica is unharmed (exit 2 if not)")
    lt.add_argument("--seed", type=int, default=0, help="--chaos: the seed of its request mix")
    lt.add_argument("--max-seconds", type=float, default=300, help="--chaos: stop sending after this long")
    lt.add_argument("--body-limit", type=int, default=1 << 20, help="--chaos: the server's max_body_bytes")
    lt.set_defaults(func=cmd_loadtest)

    d = sub.add_parser("demo", help="the tour: train a drafter on a demo budget, benchmark it, serve it (~20 min)")
    d.add_argument("--config", help="pipeline YAML (default: configs/demo.yaml)")
    d.add_argument("--bench-config", help="harness YAML (default: configs/bench/demo.yaml)")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup()
    try:
        args.func(args)
    except FlexDraftError as e:
        print(f"flexdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what a command started is stopped by its own `finally`s first
        print(f"flexdraft {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
