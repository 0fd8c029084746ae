"""Architecture description of a supported decoder (Llama, Qwen2, Qwen3), read from a HF `config.json`."""
from __future__ import annotations

from dataclasses import dataclass, field

from flexdraft.core.errors import FlexDraftError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., "factor": ...}; empty = default
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise FlexDraftError(f"unsupported model_type {arch!r}: supported are {', '.join(SUPPORTED_ARCHS)}")
        if cfg.get("use_sliding_window"):
            raise FlexDraftError("sliding-window attention (use_sliding_window=true) is not supported")
        # transformers >= 5 writes `rope_parameters`; older files have `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE:
            raise FlexDraftError(f"unsupported rope type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE)}")
        rope["rope_type"] = rope_type
        n_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch == "llama" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )


def tiny_hf_config(arch: str = "llama", **overrides) -> dict:
    """A small random-initialisable config of each supported family, for unit tests."""
    cfg = dict(
        model_type=arch,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=arch != "qwen2",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3":
        cfg["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    cfg.update(overrides)
    return cfg
