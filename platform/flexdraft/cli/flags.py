"""The flags several commands share: the runtime (model, device, dtype, threads) and the engine's knobs."""
from __future__ import annotations

import argparse


def runtime(args):
    from flexdraft.core.config import RuntimeConfig

    return RuntimeConfig(device=args.device, dtype=args.dtype, threads=args.threads)


def add_console_flags(p: argparse.ArgumentParser, when=None) -> None:
    """A long command (or, with `when(args)`, some of its uses): its terminal shows FlexDraft's lines, the
    libraries' output goes to a log (cli/console.py)."""
    p.add_argument("--verbose", action="store_true", help="show the libraries' output (Ray, DeepSpeed, MLflow) "
                   "here instead of in a log file (also FLEXDRAFT_VERBOSE=1)")
    p.set_defaults(console=when or True)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled), a .gguf file or a HF folder")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (GPU only)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (default 0: one per core)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields that are flags, with the config's defaults and help: one place for both."""
    import dataclasses

    from flexdraft.engine.config import EngineConfig
    from flexdraft.speculative.drafts import MODES

    p.add_argument("--mode", choices=MODES,
                   help="decoding mode (default: adaptive when a drafter is available, else ar)")
    for f in dataclasses.fields(EngineConfig):
        if "help" in f.metadata:
            p.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
                           default=f.default, help=f"{f.metadata['help']} (default {f.default})")


def engine_config(args):
    import dataclasses

    from flexdraft.engine.config import EngineConfig

    knobs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    return EngineConfig(mode=args.mode or "adaptive", **knobs)
