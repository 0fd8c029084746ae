"""`flexdraft demo`: the tour (cli/demo.py)."""
from __future__ import annotations

from flexdraft.cli.flags import add_console_flags


def cmd_demo(args) -> None:
    from flexdraft.cli.demo import run_demo
    from flexdraft.drafter.recipe import load_pipeline_config
    from flexdraft.evaluation.harness import load_harness_config

    run_demo(load_pipeline_config(args.config) if args.config else None,
             load_harness_config(args.bench_config) if args.bench_config else None)


def register(sub) -> None:
    d = sub.add_parser("demo", help="the tour: train a drafter on a demo budget, benchmark it, serve it "
                       "(~16 min after set-up)")
    d.add_argument("--config", help="pipeline YAML (default: configs/demo.yaml)")
    d.add_argument("--bench-config", help="harness YAML (default: configs/bench/demo.yaml)")
    add_console_flags(d)
    d.set_defaults(func=cmd_demo)
