"""The product tour (`make demo`, about 20 minutes on 2 cores): train a drafter, benchmark it, serve it, look.

1. distill -> attention tuning -> calibration through the same Ray jobs as `flexdraft pipeline`, on a demo budget
   (configs/demo.yaml); a drafter of the full-quality pipeline (configs/smollm2.yaml), when there is one, is used
   instead. Finished stages are reused.
2. a short benchmark of AR, lookup and adaptive on GSM8K, HumanEval and MT-Bench at batch 1 and 16.
3. the Serve app on loopback with that drafter, beside the same app in mode ar: a few OpenAI-client requests
   (one streamed, printed as it streams), then a loadtest at concurrency 1 and 8, adaptive against AR.
4. a summary: the speed-ups, tau, where the results are, the MLflow UI command, what to do next.

The Serve app and the Ray instances the tour starts are stopped when it ends, Ctrl-C included; the MLflow store and
the results stay.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from flexdraft.core.config import data_dir, load_yaml, read_yaml
from flexdraft.core.errors import FlexDraftError
from flexdraft.core.tracking import experiment_links, tracking_uri, ui_command
from flexdraft.drafter.recipe import PipelineConfig, load_pipeline_config
from flexdraft.evaluation.drafter_report import write_report
from flexdraft.evaluation.harness import HarnessConfig, run_harness
from flexdraft.evaluation.report import summary_table

DEMO_PIPELINE = "configs/demo.yaml"  # (the packaged copies from anywhere: `config.config_path`)
DEMO_BENCH = "configs/bench/demo.yaml"
SERVE_PORT = 8000
API_KEY = os.environ.get("FLEXDRAFT_API_KEY", "none")  # the apps ask for it when it is set (they inherit it)


def say(msg: str) -> None:
    print(msg, flush=True)


def stage(i: int, title: str) -> float:
    say(f"\n=== [{i}/4] {title}")
    return time.perf_counter()


def _train(cfg: PipelineConfig) -> tuple[PipelineConfig, dict, str]:
    """Stage 1 -> (the pipeline whose drafter the tour uses, its drafter's meta, its registered version's URI)."""
    from flexdraft.drafter.model import read_drafter_meta
    from flexdraft.training.jobs import pipeline_deadline, run_stage, shutdown_ray
    from flexdraft.training.register import register_drafter

    full = PipelineConfig()  # `flexdraft pipeline --config configs/smollm2.yaml`
    if cfg.name != full.name and (full.drafter_dir("calibration") / "drafter.json").is_file():
        say(f"using the full-quality drafter of `flexdraft pipeline` at {full.drafter_dir('calibration')}")
        return full, read_drafter_meta(full.drafter_dir("calibration")), register_drafter(full)
    say(f"demo budget: {cfg.time_budget_min:g} min of distill + training ({DEMO_PIPELINE}); the full-quality "
        f"pipeline (~30 min) is `flexdraft pipeline --config configs/smollm2.yaml`, and later tours use its drafter")
    deadline = pipeline_deadline(cfg)
    try:
        for name in ("distill", "attention", "calibration"):
            run_stage(cfg, name, deadline)
    finally:
        shutdown_ray()  # the benchmark and Serve want the cores (and Ctrl-C leaves no Ray instance)
    return cfg, read_drafter_meta(cfg.drafter_dir("calibration")), register_drafter(cfg)  # (registered by then)


def _serve_config(cfg: PipelineConfig, drafter: str) -> Path:
    """serve/config.yaml's app twice, one replica of 1 CPU each: `flexdraft` (adaptive) at / and `flexdraft-ar` (the
    same engine in mode ar) at /ar, the loadtest's baseline. drafter: the registered version both load."""
    base = read_yaml("serve/config.yaml", "Serve config")
    base["http_options"].update(host="127.0.0.1", port=SERVE_PORT)
    apps = []
    for name, route, mode in (("flexdraft", "/", "adaptive"), ("flexdraft-ar", "/ar", "ar")):
        app = yaml.safe_load(yaml.safe_dump(base["applications"][0]))
        app.update(name=name, route_prefix=route)
        app["runtime_env"]["env_vars"].update(FLEXDRAFT_HOME=str(data_dir()), MLFLOW_TRACKING_URI=tracking_uri())
        d = app["deployments"][0]
        d["ray_actor_options"] = {"num_cpus": 1}
        d["autoscaling_config"].update(min_replicas=1, max_replicas=1)
        d["user_config"].update(drafter=drafter, store=str(cfg.distill_dir()),
                                served_model_name="smollm2")
        d["user_config"]["engine"]["mode"] = mode
        apps.append(app)
    base["applications"] = apps
    path = data_dir() / "demo" / "serve.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def _wait_healthy(proc: subprocess.Popen, urls: list[str], log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise FlexDraftError(f"`serve run` ended (exit {proc.returncode}); its log {log} ends:\n"
                                 + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        try:
            if all(httpx.get(f"{u}/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5).status_code
                   == 200 for u in urls):
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise FlexDraftError(f"the Serve apps did not answer /health in {timeout:.0f} s; see {log}")


def _client_requests(url: str) -> None:
    """What a user of the endpoint does first: list the model, ask, stream."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    say(f"  GET /v1/models -> {model}")
    for question in ("What is the capital of France?", "Name three primary colors."):
        t = time.perf_counter()
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                             max_tokens=32, temperature=0)
        say(f"  {question!r} -> {out.choices[0].message.content.strip()!r} "
            f"({out.usage.completion_tokens} tokens, {time.perf_counter() - t:.1f} s)")
    question = "Write a haiku about the sea."
    say(f"  {question!r} streamed ->")
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=48, temperature=0, stream=True)
    print("    ", end="", flush=True)
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            print(c.choices[0].delta.content.replace("\n", "\n    "), end="", flush=True)
    print(flush=True)


def _serve(cfg: PipelineConfig, drafter: str) -> dict:
    """Stage 3: `serve run` of the two apps, requests, the loadtest; the Serve app and its Ray instance are stopped
    whatever happens. -> the loadtest's results."""
    from flexdraft.evaluation.loadtest import run_loadtest

    config, log = _serve_config(cfg, drafter), data_dir() / "demo" / "serve.log"
    url = f"http://127.0.0.1:{SERVE_PORT}"
    serve_bin = str(Path(sys.executable).parent / "serve")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)  # a Ray instance of its own, ended with it
    with open(log, "w") as out:
        proc = subprocess.Popen([serve_bin, "run", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        t = time.perf_counter()
        _wait_healthy(proc, [url, f"{url}/ar"], log)
        say(f"  two apps up in {time.perf_counter() - t:.0f} s: adaptive at {url}/v1, ar at {url}/ar/v1 "
            f"(config {config}, log {log})")
        _client_requests(url)
        say("  loadtest: GSM8K prompts, 8 requests per level, streamed, adaptive and ar taking turns")
        return run_loadtest(url, "gsm8k", [1, 8], 8, stream=True, max_tokens=48, baseline=f"{url}/ar", api_key=API_KEY,
                            output=data_dir() / "demo" / "loadtest.json")
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to `serve run` (it shuts down its apps and its Ray instance), then what is left of its session."""
    from flexdraft.cluster.local import end_session

    end_session(proc.pid, signal.SIGINT, grace_s=60)
    proc.wait()


def _dashboards(experiments: list[str]) -> str:
    """The summary's MLflow lines: the command that starts the UI, then a link per experiment to its runs."""
    links = experiment_links(experiments)
    width = max(map(len, links), default=0)
    lines = [ui_command() or f"the tracking server at {tracking_uri()}"] + [
        f"{name:<{width}}  {url}" for name, url in links.items()]
    return "  dashboards: " + "\n              ".join(lines) + "\n"


def run_demo(pipeline: PipelineConfig | None = None, bench: HarnessConfig | None = None) -> dict:
    cfg = pipeline or load_pipeline_config(DEMO_PIPELINE)
    bench = bench or load_yaml(HarnessConfig, DEMO_BENCH)
    t_start, times = time.perf_counter(), {}

    t = stage(1, "train a drafter: self-distillation (Ray actors), attention tuning and calibration (Ray Train + "
                 "DeepSpeed)")
    cfg, meta, version = _train(cfg)
    times["train"] = time.perf_counter() - t
    ev = meta["eval"]
    say(f"-> drafter {version} ({cfg.drafter_dir('calibration')}): validation tau {ev['eval/bonus/tau']:.2f} tokens "
        f"per target forward (block drafting, masked+calibrated {ev['eval/mask_calibrated/tau']:.2f}), "
        f"{times['train'] / 60:.1f} min")

    bench.drafter = bench.drafter or version
    bench.store = bench.store or str(cfg.distill_dir())
    t = stage(2, f"benchmark: {', '.join(bench.methods)} x batch {bench.batch_sizes} x {', '.join(bench.datasets)}, "
                 "side by side")
    results = run_harness(bench)
    times["benchmark"] = time.perf_counter() - t
    say("\n" + summary_table(results) + "\n\n" + results["noise_floor"])

    t = stage(3, "serve: the OpenAI-compatible Ray Serve app on 127.0.0.1, adaptive and ar side by side")
    load = _serve(cfg, version)
    times["serve"] = time.perf_counter() - t
    for c, r in load.items():
        say(f"-> concurrency {c}: adaptive {r['tokens_per_s']:.1f} tok/s, ar {r['baseline']['tokens_per_s']:.1f} "
            f"tok/s: {r['speedup']:.2f}x ({r['errors'] + r['baseline']['errors']} errors)")

    stage(4, "summary")
    say(summary_table(results) + "\n\nServed, streamed, adaptive against ar: " + ", ".join(
        f"{r['speedup']:.2f}x at concurrency {c}" for c, r in load.items()) + f"; the drafter's validation tau "
        f"{ev['eval/bonus/tau']:.2f}\n")
    say(f"done in {(time.perf_counter() - t_start) / 60:.1f} min ("
        + ", ".join(f"{k} {v / 60:.1f}" for k, v in times.items()) + ")\n"
        f"  drafter:    {version} (flexdraft drafters show {version})\n"
        f"  report:     {write_report(version)}\n"
        f"  benchmark:  {results['output_dir']}/results.md (per dataset), *.png (plots)\n"
        f"  loadtest:   {data_dir() / 'demo' / 'loadtest.json'}\n"
        + _dashboards([cfg.mlflow_experiment, bench.mlflow_experiment, "flexdraft-serve", "flexdraft-loadtest"]) +
        "  next:       flexdraft pipeline --config configs/smollm2.yaml   (the full-quality drafter, ~30 min)\n"
        "              flexdraft serve                                    (the app, until Ctrl-C)\n"
        "              flexdraft sweep --config tuning/configs/decode.yaml (this machine's policy, ~12 min)\n"
        "              flexdraft cluster up                               (scale out: docs/scaling.md)")
    return {"bench": results, "loadtest": load, "times": times}
