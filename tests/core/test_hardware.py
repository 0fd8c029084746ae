"""The hardware probe picks the fast path where the machine has it and a correct one elsewhere: on a CPU without
AVX-512 or native bf16 nothing is prepacked in bf16, `auto` means float32, and an explicit bfloat16 still runs."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_hf
from flexdraft.core import hardware
from flexdraft.core.config import RuntimeConfig
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.models.linear import Linear
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

# what an AVX2-only x86-64 CPU (e.g. an AMD EPYC of family 23) gives oneDNN and ATen, on any x86-64 CPU
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FLEXDRAFT = str(Path(sys.executable).parent / "flexdraft")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_hf("llama", folder)
    return folder


def packed(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Linear) and m.packed is not None]


def test_auto_takes_the_fast_path_where_the_probe_finds_it(tiny_folder):
    """`auto` is bfloat16 exactly where the CPU has native bf16, and the default runtime prepacks exactly the
    dtypes oneDNN can pack here (on an AMX or AVX512-BF16 CPU: bf16, prepacked)."""
    caps = hardware.probe()
    auto = RuntimeConfig(device="cpu")
    assert auto.dtype_name() == ("bfloat16" if caps.cpu_bf16 else "float32")
    model = load_model(tiny_folder, auto, with_tokenizer=False).model
    assert bool(packed(model)) == caps.can_prepack(model.dtype)


@pytest.fixture
def no_fast_path(monkeypatch):
    """The probe says: no native bf16, nothing oneDNN can prepack (what it finds on an AVX2-only CPU)."""
    caps = dataclasses.replace(hardware.probe(), cpu_bf16=False, prepack=())
    monkeypatch.setattr(hardware, "_probed", caps)
    return caps


def test_without_fast_paths_the_engine_runs_plain_linears_and_stays_lossless(tiny_folder, no_fast_path):
    """Through the probe alone (even on an AMX machine): `auto` loads float32, a bf16 load asked for by name
    prepacks nothing in the target nor in the drafter the engine pairs with it, and parallel decoding with a
    perturbed drafter gives AR's greedy tokens in both dtypes."""
    assert RuntimeConfig(device="cpu").torch_dtype() == torch.float32
    prompts, params = [[5, 6, 7, 8], [9] * 6, [11, 12]], SamplingParams(max_new_tokens=16)
    for dtype in ("auto", "bfloat16"):
        target = load_model(tiny_folder, RuntimeConfig(device="cpu", dtype=dtype, threads=1),
                            with_tokenizer=False).model
        torch.manual_seed(0)
        drafter = Drafter.from_target(target, DrafterConfig(k=2, block_size=4))
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        engine = Engine(target, drafter.to_runtime(target), EngineConfig(mode="parallel", max_batch=3))
        assert packed(target) == [] and packed(drafter) == []
        ours = [g.token_ids for g in engine.generate(prompts, params)]
        assert ours == [g.token_ids for g in generate(target, prompts, params)]


def test_an_avx2_cpu_runs_bf16_emulated_and_auto_picks_float32(tiny_folder):
    """With oneDNN and ATen capped to AVX2 (they then refuse bf16 prepacking exactly as an AVX2-only CPU does:
    'bf16 path needs the cpu support avx_ne_convert or avx512bw...'), a fresh process probes no native bf16 and
    no bf16 prepack; `auto` loads float32; an explicit bfloat16 load runs unpacked, its logits track fp32's (as
    test_model's bf16 check asks), and it says once that it is emulated; `flexdraft env` reports all of it."""
    script = f"""
import json, logging, sys, torch
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.hardware import probe
from flexdraft.models.loading import load_model
logging.basicConfig(stream=sys.stderr)
out = {{"probe": [probe().cpu_bf16, list(probe().prepack)]}}
tokens = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(2))
pos = torch.arange(24).expand(2, 24)
for dtype in ("auto", "bfloat16", "bfloat16"):
    m = load_model({str(tiny_folder)!r}, RuntimeConfig(device="cpu", dtype=dtype, threads=1),
                   with_tokenizer=False).model
    with torch.inference_mode():
        logits = m.logits(m(tokens, pos, m.new_cache(2, 24))).float()
    out[dtype] = [str(m.dtype), m.lm_head.packed is not None, logits.tolist()]
print(json.dumps(out))
"""
    env = {**os.environ, **AVX2_ONLY}
    capped = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert capped.returncode == 0, capped.stderr[-2000:]
    got = json.loads(capped.stdout)
    assert got["probe"] == [False, ["float32"]]
    assert got["auto"][:1] == ["torch.float32"]
    assert got["bfloat16"][:2] == ["torch.bfloat16", False]
    assert capped.stderr.count("is emulated") == 1
    a, b = torch.tensor(got["auto"][2]), torch.tensor(got["bfloat16"][2])
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).abs().max() < 0.1 * a.abs().max()

    env_out = subprocess.run([FLEXDRAFT, "env", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert env_out.returncode == 0, env_out.stderr[-2000:]
    report = json.loads(env_out.stdout)
    assert report["hardware"]["native_bf16_cpu"] == "False" and report["hardware"]["cpu_isa"] == "AVX2"
    assert report["auto"]["dtype"] == "float32" and report["auto"]["device"] == "cpu"
    assert report["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert set(report["versions"]) >= {"torch", "ray", "deepspeed", "transformers", "mlflow"}
    assert "not installed" not in report["versions"].values()
