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
    p.add_argument("--proposer", action="append", default=[], metavar="NAME[=JSON]",
                   help="a draft source beside prompt lookup (repeatable): a registered name, an entry point of group "
                        "flexdraft.proposers or an import path module:attribute, its settings as a JSON object")
    for f in dataclasses.fields(EngineConfig):
        if "help" in f.metadata:
            p.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
                           default=f.default, help=f"{f.metadata['help']} (default {f.default})")


def engine_config(args):
    import dataclasses

    from flexdraft.engine.config import EngineConfig

    knobs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    return EngineConfig(mode=args.mode or "adaptive", proposers=proposer_settings(args.proposer), **knobs)


def proposer_settings(flags: list[str]) -> dict:
    """--proposer NAME[=JSON] flags -> {name: settings} (EngineConfig.proposers)."""
    import json

    from flexdraft.core.errors import FlexDraftError

    out = {}
    for flag in flags:
        name, _, settings = flag.partition("=")
        try:
            out[name] = json.loads(settings) if settings else {}
        except json.JSONDecodeError as e:
            raise FlexDraftError(f"--proposer {flag}: its settings are not JSON ({e})") from None
        if not isinstance(out[name], dict):
            raise FlexDraftError(f"--proposer {flag}: settings must be a JSON object")
    return out
