"""Typed configuration: dataclasses built from YAML/dicts, strictly (unknown keys and wrong types are errors)."""
from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from flexdraft.core.errors import FlexDraftError
from flexdraft.core.hardware import probe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def data_dir() -> Path:
    """Where converted models, the MLflow store and job outputs live: $FLEXDRAFT_HOME or ~/.flexdraft."""
    path = Path(os.environ.get("FLEXDRAFT_HOME", Path.home() / ".flexdraft")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class RuntimeConfig:
    device: str = "auto"  # auto = cuda when available, else cpu
    # auto = bfloat16 where the device has native bf16 (CUDA; AVX512-BF16 / AMX CPUs), else float32 (hardware.probe)
    dtype: str = "auto"
    # torch intra-op threads on CPU; 0 = $OMP_NUM_THREADS when set (Ray sets it to a task's or actor's num_cpus),
    # else one per core available to this process. One process alone: one per core is fastest; processes that
    # share the cores (Ray workers, a Serve replica beside its proxy and clients) take their share.
    threads: int = 0
    # oneDNN-prepacked linear weights on CPU (inference; 1.5-2x faster GEMMs), where oneDNN can pack the dtype
    cpu_prepack: bool = True
    # attention kernel for bf16/fp16 on CPU: sdpa, math (explicit matmuls), or auto = whichever a micro-benchmark
    # at load time finds faster on this CPU (models.attention.cpu_attention_kernel); fp32 and CUDA use SDPA
    cpu_attention: str = "auto"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise FlexDraftError(f"device {self.device!r} requested but CUDA is not available")
        return torch.device(self.device)

    def dtype_name(self) -> str:
        """The dtype this config means on its device: `auto` resolved by the hardware probe."""
        device = self.torch_device().type
        if self.dtype == "auto":
            return probe().auto_dtype(device)
        if self.dtype not in DTYPES:
            raise FlexDraftError(f"unknown dtype {self.dtype!r}: use one of auto, {', '.join(DTYPES)}")
        if self.dtype == "float16" and device == "cpu":
            raise FlexDraftError("dtype float16 is GPU-only: use float32 or bfloat16 on CPU")
        return self.dtype

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name()]

    def apply(self) -> None:
        if self.threads < 0:
            raise FlexDraftError(f"threads must be >= 0 (0 = $OMP_NUM_THREADS, else one per core), got {self.threads}")
        if self.cpu_attention not in ("auto", "sdpa", "math"):
            raise FlexDraftError(f"cpu_attention must be auto, sdpa or math, got {self.cpu_attention!r}")
        if self.torch_device().type == "cpu":
            torch.set_num_threads(self.threads or self.default_threads())

    @staticmethod
    def default_threads() -> int:
        omp = os.environ.get("OMP_NUM_THREADS", "")
        return int(omp) if omp.isdigit() and int(omp) > 0 else len(os.sched_getaffinity(0))


def _check_type(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(
            _check_type(v, typing.get_args(hint)[0]) for v in value) if typing.get_args(hint) else True
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict) or isinstance(value, hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # its value's name (the dataclass converts it)
        return isinstance(value, hint) or isinstance(value, str)
    return isinstance(value, hint)


def from_dict(cls, data: dict | None, where: str = ""):
    """Build dataclass `cls` from `data`, recursing into nested dataclasses (a nested section's missing keys take
    the field's default, e.g. `calibration: {lr: 3e-3}` keeps the calibration default's steps); unknown keys and
    wrong types raise FlexDraftError naming the key. A class with a `check_mapping(data)` classmethod sees the
    mapping first (what was written, not only what it makes, e.g. two keys that must not both be set)."""
    data = data or {}
    if not isinstance(data, dict):
        raise FlexDraftError(f"config{where}: expected a mapping, got {type(data).__name__}")
    if hasattr(cls, "check_mapping"):
        cls.check_mapping(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields.keys())
    if unknown:
        raise FlexDraftError(f"config{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if not _check_type(value, hint):
            raise FlexDraftError(f"config{where}.{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            factory = fields[key].default_factory
            default = dataclasses.asdict(factory()) if factory is not dataclasses.MISSING else {}
            value = from_dict(hint, {**default, **value}, f"{where}.{key}")
        elif hint is float:  # YAML's 12 for a float field: 12.0, as the default is, so config hashes agree
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


# The configs the commands need ship inside the package; the repository's configs/, tuning/configs/,
# serve/config.yaml and infra/local/cluster.yaml are links to them.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
_REPO_PATHS = (("configs/", ""), ("tuning/configs/", "sweeps/"), ("serve/config.yaml", "serve/config.yaml"),
               ("infra/local/cluster.yaml", "cluster/local.yaml"))


def config_path(path: str | Path) -> Path:
    """A config file as named on the command line: the file itself when it exists, else, for a repository path
    (`configs/demo.yaml`, `tuning/configs/decode.yaml`, `serve/config.yaml`, ...), its packaged copy, so the
    documented commands run from any directory and from a non-editable install."""
    path = Path(path).expanduser()
    if path.exists() or path.is_absolute():
        return path
    name = path.as_posix().removeprefix("./")
    for repo, packaged in _REPO_PATHS:
        if name.startswith(repo) and (CONFIGS / (packaged + name[len(repo):])).is_file():
            return CONFIGS / (packaged + name[len(repo):])
    return path


def read_yaml(path: str | Path, what: str = "config file"):
    """The parsed YAML of `path` (`config_path`); a missing file or bad YAML is a FlexDraftError naming `what` and
    the path."""
    path = config_path(path)
    if not path.is_file():
        raise FlexDraftError(f"{what} not found: {path}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise FlexDraftError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None


def load_yaml(cls, path: str | Path):
    return from_dict(cls, read_yaml(path))
