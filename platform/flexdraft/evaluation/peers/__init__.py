"""Peers: the inference stacks a user would run instead, on the same weights, prompts and cores, as methods of
`flexdraft bench` (`--peers vllm`). vLLM for CPU pins its own builds of transformers, so it lives in a venv of its
own (`make peer-vllm`) and runs in a subprocess (`vllm_worker.py`) that the harness sends prompt token ids to,
one cell at a time, between its own methods' runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flexdraft.core.errors import FlexDraftError

WORKER = Path(__file__).with_name("vllm_worker.py")
PEER_VENV = ".venv-vllm"  # where `make peer-vllm` installs vLLM, in the repository root


@dataclass(frozen=True)
class PeerSpec:
    """One vLLM configuration: its speculative_config (None: plain AR) and what the results say of it."""
    speculative: dict | None
    about: str


PEERS = {
    "vllm": PeerSpec(None, "vLLM for CPU, plain AR (its own venv; greedy, same prompt ids, dtype and cores)"),
    "vllm-ngram": PeerSpec({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2}, "vLLM for CPU with its n-gram (prompt lookup) speculation, "
                           "4 tokens"),
}
PEER_GROUPS = {"vllm": ["vllm", "vllm-ngram"]}  # what `--peers NAME` adds to the methods


def peer_python(given: str = "") -> Path:
    """The peer venv's interpreter: `given`, else $FLEXDRAFT_VLLM_PYTHON, else ./.venv-vllm/bin/python."""
    path = Path(given or os.environ.get("FLEXDRAFT_VLLM_PYTHON") or Path(PEER_VENV) / "bin" / "python").expanduser()
    if not path.is_file():
        raise FlexDraftError(f"the vLLM peer needs its own venv and {path} does not exist: run `make peer-vllm` "
                             "in the repository root (or set FLEXDRAFT_VLLM_PYTHON to that venv's python)")
    return path


class Peer:
    """A vLLM `LLM` loaded once in a worker process; `run` decodes prompt ids greedily in static batches."""

    def __init__(self, name: str, python: Path, model_dir: Path, dtype: str, threads: int, max_model_len: int,
                 max_num_seqs: int, prefix_caching: bool = False):
        """prefix_caching: vLLM's automatic prefix caching, off by default: the harness decodes the same prompts in
        its warm-up and every repeat, and the cache would skip their prefill from the second time on (HumanEval at
        batch 16: 0.18 s instead of 0.52), which fresh prompts never get; our engine prefills every request."""
        spec = PEERS[name]
        self.name = name
        config = {"model": str(model_dir), "dtype": dtype, "speculative": spec.speculative,
                  "cpus": f"0-{threads - 1}" if threads > 1 else "0", "max_model_len": max_model_len,
                  "max_num_seqs": max_num_seqs, "enable_prefix_caching": prefix_caching}
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
        self.info = self._answer()["ready"]
        self.flags = {k: config[k] for k in ("dtype", "max_model_len", "max_num_seqs", "enable_prefix_caching",
                                             "speculative")}

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
