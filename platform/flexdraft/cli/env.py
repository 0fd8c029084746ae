"""`flexdraft env`: what this machine can run fast and what `auto` resolves to (for bug reports)."""
from __future__ import annotations

import json
from pathlib import Path

VERSIONS = ("flexdraft", "torch", "ray", "deepspeed", "transformers", "mlflow", "datasets", "safetensors")
ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "FLEXDRAFT_HOME",
            "FLEXDRAFT_CPU_KERNELS", "FLEXDRAFT_CPU_GEMV", "FLEXDRAFT_CPU_AMX",
            "FLEXDRAFT_CPU_STACK", "FLEXDRAFT_KERNELS_DIR")


def env_report(model: str) -> dict:
    """What the hardware probe found, what each `auto` resolves to here, versions and the relevant env vars."""
    import importlib.metadata
    import json as json_
    import os
    import platform

    import torch

    from flexdraft.core.config import RuntimeConfig, data_dir
    from flexdraft.core.hardware import probe
    from flexdraft.models import kernels
    from flexdraft.models.attention import cpu_attention_kernel
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import BUNDLED, bundled_gguf, gguf_cache_folder

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
                 "cpu_kernels": (f"C++: decode attention, fused ops{', decoder stack' if kernels.stack_wanted() else ''}"
                                 f"{', bf16 GEMV' if kernels.gemv_available() else ''}"
                                 f"{', bf16 AMX tiles' if kernels.amx_available() else ''}"
                                 f" ({caps.cpu_isa}, {kernels.cache_dir()})"
                                 if device.type == "cpu" and kernels.load() else "none (PyTorch ops)"),
                 "threads": str(torch.get_num_threads())},
        "versions": versions,
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "data_dir": str(data_dir()),
    }


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


def register(sub) -> None:
    e = sub.add_parser("env", help="what this machine can run fast and what `auto` resolves to (for bug reports)")
    e.add_argument("--model", default="smollm2", help="the model whose attention kernel choice to show")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_env)
