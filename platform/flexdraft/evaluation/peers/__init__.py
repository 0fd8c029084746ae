"""Peers: the inference stacks a user would run instead, on the same weights, prompts and cores, as methods of
`flexdraft bench` (`--peers vllm llama.cpp`). Each pins its own builds (vLLM for CPU its transformers, llama.cpp a
compiled library), so each lives in a venv of its own (`make peer-vllm`, `make peer-llama`) and runs in a
subprocess (its `*_worker.py`) that the harness sends prompt token ids to, one cell at a time, between its own
methods' runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flexdraft.core.errors import FlexDraftError


@dataclass(frozen=True)
class Stack:
    """A peer's inference stack: its worker script, the venv `make` installs it into (in the repository root), the
    variable that names another venv's python, and the make target."""
    name: str
    worker: Path
    venv: str
    env: str
    target: str


HERE = Path(__file__).parent
STACKS = {
    "vllm": Stack("vLLM", HERE / "vllm_worker.py", ".venv-vllm", "FLEXDRAFT_VLLM_PYTHON", "peer-vllm"),
    "llama.cpp": Stack("llama.cpp", HERE / "llama_cpp_worker.py", ".venv-llama", "FLEXDRAFT_LLAMA_PYTHON",
                       "peer-llama"),
}


@dataclass(frozen=True)
class PeerSpec:
    """One peer configuration: its stack, vLLM's speculative_config (None: plain AR) and what the results say of it."""
    stack: str
    speculative: dict | None
    about: str


PEERS = {
    "vllm": PeerSpec("vllm", None, "vLLM for CPU, plain AR (its own venv; greedy, same prompt ids, dtype and cores)"),
    "vllm-ngram": PeerSpec("vllm", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}, "vLLM for CPU with its n-gram (prompt lookup) "
                           "speculation, 4 tokens"),
    "llama.cpp": PeerSpec("llama.cpp", None, "llama.cpp through llama-cpp-python, plain AR, the same GGUF converted to "
                          "the run's dtype by llama.cpp (its own venv; greedy, same prompt ids and cores)"),
}
PEER_GROUPS = {"vllm": ["vllm", "vllm-ngram"], "llama.cpp": ["llama.cpp"]}  # what `--peers NAME` adds


def peer_python(stack: str = "vllm", given: str = "") -> Path:
    """A peer venv's interpreter: `given`, else $<the stack's variable>, else ./<its venv>/bin/python."""
    s = STACKS[stack]
    path = Path(given or os.environ.get(s.env) or Path(s.venv) / "bin" / "python").expanduser()
    if not path.is_file():
        raise FlexDraftError(f"the {s.name} peer needs its own venv and {path} does not exist: run `make {s.target}` "
                             f"in the repository root (or set {s.env} to that venv's python)")
    return path


class Peer:
    """A peer's model loaded once in its worker process; `run` decodes prompt ids greedily in static batches."""

    def __init__(self, name: str, python: Path, model_dir: Path, dtype: str, threads: int, max_model_len: int,
                 max_num_seqs: int, prefix_caching: bool = False, gguf: Path | None = None, cache_dir: Path | None = None):
        """model_dir: the HF folder (vLLM); gguf: the GGUF it was converted from and cache_dir, where the GGUF in
        `dtype` is kept (llama.cpp). prefix_caching: vLLM's automatic prefix caching, off by default: the harness
        decodes the same prompts in its warm-up and every repeat, and the cache would skip their prefill from the
        second time on (HumanEval at batch 16: 0.18 s instead of 0.52), which fresh prompts never get; our engine
        prefills every request."""
        spec = PEERS[name]
        self.name = name
        common = {"dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
        if spec.stack == "vllm":
            config = {**common, "model": str(model_dir), "speculative": spec.speculative,
                      "cpus": f"0-{threads - 1}" if threads > 1 else "0", "enable_prefix_caching": prefix_caching}
            shown = ("dtype", "max_model_len", "max_num_seqs", "enable_prefix_caching", "speculative")
        else:
            config = {**common, "gguf": str(gguf), "threads": threads, "cache_dir": str(cache_dir)}
            shown = ("dtype", "max_model_len", "max_num_seqs", "threads")
        self.proc = subprocess.Popen([str(python), str(STACKS[spec.stack].worker), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
        self.info = self._answer()["ready"]
        self.flags = {k: config[k] for k in shown}

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise FlexDraftError(f"the {self.name} peer exited (code {code}) before answering: its log is above")
        return json.loads(line)

    def run(self, prompts: list[list[int]], batch: int, max_new_tokens: int, stop_token_ids: list[int]) -> dict:
        """-> {"outputs": [[ids]], "seconds": wall seconds of prefill + decoding of all prompts}."""
        req = {"prompts": prompts, "batch": batch, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the worker: stdin closed (it exits after its last answer), killed if it has not within a minute."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
