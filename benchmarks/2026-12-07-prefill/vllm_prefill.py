"""vLLM's prefill and decode step at batch 16, with and without its automatic prefix caching: each dataset's 16
bench prompts (as `flexdraft bench` builds them) through the harness's vLLM peer worker, greedy, with 1, 2 and 64
new tokens (best of 3 after two warm-ups on the same prompts, as the harness repeats them), bf16, 2 cores. The
1-token run is the prefill; (64 - 2) / 62 is a decode step. Needs `make peer-vllm`.

    python benchmarks/2026-12-07-prefill/vllm_prefill.py
"""
from __future__ import annotations

import flexdraft.evaluation.peers as peers
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.ar import generate
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams


def main() -> None:
    lm = load_model("smollm2", RuntimeConfig(device="cpu", dtype="bfloat16", threads=2))
    answer = lambda ps: [g.token_ids for g in generate(  # noqa: E731
        lm.model, ps, SamplingParams(max_new_tokens=128), lm.eos_token_ids)]
    sets = {n: [p.ids for p in bench_prompts(n, lm.tokenizer, 16, 0, answer)] for n in ("gsm8k", "humaneval", "mt-bench")}
    print("\n| prefix caching | dataset | prompt tokens | 1 token s | 64 tokens s | decode step ms |")
    print("|---|---|---|---|---|---|")
    for caching in (True, False):
        with peers.Peer("vllm", peers.peer_python(), lm.folder, "bfloat16", 2, 1024, 16, caching) as peer:
            for name, prompts in sets.items():
                seconds = {}
                for n in (1, 2, 64):
                    for _ in range(2):
                        peer.run(prompts, 16, n, [])
                    seconds[n] = min(peer.run(prompts, 16, n, [])["seconds"] for _ in range(3))
                step = (seconds[64] - seconds[2]) / 62 * 1000
                print(f"| {'on' if caching else 'off'} | {name} | {sum(map(len, prompts))} | {seconds[1]:.3f} | "
                      f"{seconds[64]:.3f} | {step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
