"""The training commands: the pipeline's stages (`distill`, `tune-attention`, `calibrate`, `pipeline`) and `sweep`."""
from __future__ import annotations

import sys

from flexdraft.cli.flags import add_console_flags


def cmd_job(args) -> None:
    """The Ray jobs of jobs/*.py, on a local Ray instance or the cluster in RAY_ADDRESS."""
    from flexdraft.drafter.recipe import load_pipeline_config
    from flexdraft.training.jobs import run_stage

    run_stage(load_pipeline_config(args.config), args.stage)


def cmd_sweep(args) -> None:
    """The Tune driver (`tuning.tuner`, as tuning/sweep.py runs it) as its own process: its Ray session ends with it."""
    import subprocess

    argv = ["--config", args.config] + (["--drafter", args.drafter] if args.drafter else []) + \
        (["--resume"] if args.resume else [])
    rc = subprocess.call([sys.executable, "-m", "flexdraft.tuning.tuner", *argv])
    if rc:
        sys.exit(rc)


def register(sub) -> None:
    for name, stage, help_ in [("distill", "distill", "self-distillation data (Ray actors)"),
                               ("tune-attention", "attention", "attention tuning (Ray Train + DeepSpeed)"),
                               ("calibrate", "calibration", "calibration MLP (Ray Train + DeepSpeed)"),
                               ("pipeline", "pipeline", "distill, then attention tuning, then calibration")]:
        j = sub.add_parser(name, help=help_)
        j.add_argument("--config", default="configs/smollm2.yaml", help="pipeline YAML")
        add_console_flags(j)
        j.set_defaults(func=cmd_job, stage=stage)
    w = sub.add_parser("sweep", help="Ray Tune sweep of decode-time or training-time settings -> a policy file")
    w.add_argument("--config", default="tuning/configs/decode.yaml",
                   help="sweep YAML (repository paths resolve to the packaged copies from anywhere)")
    w.add_argument("--drafter", help="decode sweeps: the drafter to sweep over, a folder or models:/... (a registered "
                                     "version gets the exported policy attached; default: the config's)")
    w.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this name")
    add_console_flags(w)
    w.set_defaults(func=cmd_sweep)
