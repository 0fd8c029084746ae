"""The main job (`make demo`): the whole pipeline on the embedded defaults, then a quick benchmark.

distill (Ray actors) -> attention tuning -> calibration (Ray Train + DeepSpeed), exactly what
`flexdraft pipeline --config configs/smollm2.yaml` runs, each stage reused when it finished earlier with the
same config; then the harness on the three datasets with the main methods, and where to look at it all.
"""
from __future__ import annotations

import time

from flexdraft.harness import HarnessConfig, run_harness, summary_table
from flexdraft.pipeline import PipelineConfig
from flexdraft.tracking import tracking_uri

# A short run of the harness (~15-20 min on a 2-core CPU); `flexdraft bench` runs every method.
DEMO_BENCH = dict(batch_sizes=[1, 4, 16], samples=4, max_new_tokens=48, profile=False,
                  methods=["ar", "ar-control", "hf-generate", "hf-prompt-lookup", "lookup", "sequential", "tree",
                           "parallel-pruned", "adaptive-drafter", "adaptive-no-store", "adaptive"])


def run_demo(pipeline: PipelineConfig | None = None, bench: HarnessConfig | None = None) -> dict:
    from flexdraft.jobs import pipeline_deadline, run_stage, shutdown_ray

    cfg = pipeline or PipelineConfig()
    t_start, times, deadline = time.perf_counter(), {}, pipeline_deadline(cfg)
    stages = [("distill", "self-distillation data: the target answers ShareGPT prompts (Ray actors)"),
              ("attention", "attention tuning of the deep layers' projectors (Ray Train + DeepSpeed)"),
              ("calibration", "bonus-guided calibration MLP (Ray Train + DeepSpeed)")]
    for i, (stage, what) in enumerate(stages, 1):
        print(f"\n=== [{i}/4] {what}", flush=True)
        t = time.perf_counter()
        run_stage(cfg, stage, deadline)
        times[stage] = time.perf_counter() - t
    shutdown_ray()  # the benchmark runs in this process and wants both cores

    bench = bench or HarnessConfig(model=cfg.model, **DEMO_BENCH)
    bench.drafter = bench.drafter or str(cfg.drafter_dir("calibration"))
    print(f"\n=== [4/4] benchmark: {len(bench.methods)} methods x batch {bench.batch_sizes} x {', '.join(bench.datasets)}, "
          "side by side", flush=True)
    t = time.perf_counter()
    results = run_harness(bench)
    times["benchmark"] = time.perf_counter() - t
    print("\n" + summary_table(results) + "\n\n" + results["noise_floor"], flush=True)
    print("\n=== done in " + f"{(time.perf_counter() - t_start) / 60:.1f} min (" +
          ", ".join(f"{k} {v / 60:.1f}" for k, v in times.items()) + ")\n"
          f"    drafter:   {cfg.drafter_dir('calibration')}\n"
          f"    results:   {results['output_dir']}/results.md (tables, per dataset), *.png (plots)\n"
          f"    dashboard: mlflow ui --backend-store-uri {tracking_uri()}  (experiments {cfg.mlflow_experiment}, "
          f"{bench.mlflow_experiment})", flush=True)
    return results
