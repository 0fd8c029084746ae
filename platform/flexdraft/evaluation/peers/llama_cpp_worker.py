"""llama.cpp (through llama-cpp-python's C API bindings) serving the harness over stdin/stdout: run by the peer venv's
Python, not ours, so this file imports nothing of flexdraft.

    <peer venv>/bin/python llama_cpp_worker.py '{"gguf": FILE, "dtype": "bfloat16", "threads": 2,
                                                 "max_model_len": 1024, "max_num_seqs": 16, "cache_dir": DIR}'

The GGUF as shipped (SmolLM2's is Q4_1) is turned into the run's dtype once with llama.cpp's own
`llama_model_quantize` (Q4_1 -> BF16 or F32: each weight dequantised, then rounded to the dtype, which is what our
loader does to the same file), cached in cache_dir. It loads that model once, prints {"ready": {...}} and answers
one JSON line per request line: {"prompts": [[ids]], "batch": b, "max_new_tokens": n, "stop_token_ids": [...]} ->
{"outputs": [[ids]], "seconds": s, "tau": null}: prompts in static batches of b, each batch as llama.cpp's
`batched` example runs one (every prompt a sequence of its own in one KV cache, the prompts' tokens decoded
together, then one token per live sequence per decode), greedy (argmax of the logits); the time covers prefill and
decoding, not loading. A stop token ends its sequence and is part of its output, as in vLLM's.
"""
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

FTYPES = {"bfloat16": L.LLAMA_FTYPE_MOSTLY_BF16, "float32": L.LLAMA_FTYPE_ALL_F32}
GGML_TYPE_F32 = 0  # an fp32 run keeps its KV cache in fp32 too (the default, f16, is what a bf16 run gets)
PREFILL_TOKENS = 2048  # tokens per decode call while the prompts go in (llama.cpp's n_batch)


def converted(gguf: Path, dtype: str, cache_dir: Path, threads: int) -> Path:
    """The GGUF in `dtype`, made once by llama.cpp's quantize tool (which dequantises a quantized source)."""
    st = gguf.stat()
    out = cache_dir / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}.{dtype}.gguf"
    if not out.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        params = L.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[dtype], True, threads
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        if L.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize could not convert {gguf} to {dtype}")
        tmp.rename(out)
    return out


class Runner:
    def __init__(self, spec: dict):
        threads, seqs = spec["threads"], spec["max_num_seqs"]
        L.llama_backend_init()
        path = converted(Path(spec["gguf"]), spec["dtype"], Path(spec["cache_dir"]), threads)
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx = spec["max_model_len"] * seqs  # every sequence its own max_model_len
        params.n_batch = params.n_ubatch = PREFILL_TOKENS
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = threads
        if spec["dtype"] == "float32":
            params.type_k = params.type_v = GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(PREFILL_TOKENS, 0, 1)
        self.file = path.name

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries (token, position, sequence, wants logits) in one decode -> the argmax after each that wants one."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if L.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        out = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                out.append(int(row.argmax()))
        return out

    def generate(self, prompts: list[list[int]], max_new: int, stop: set[int]) -> list[list[int]]:
        """Greedy continuations of prompts decoded together, sequence i = prompt i."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        entries = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        first = []
        for i in range(0, len(entries), PREFILL_TOKENS):
            first += self.decode(entries[i:i + PREFILL_TOKENS])
        outputs = [[t] for t in first]
        live = [s for s, o in enumerate(outputs) if o[-1] not in stop and len(o) < max_new]
        while live:
            nxt = self.decode([(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True) for s in live])
            for s, t in zip(live, nxt):
                outputs[s].append(t)
            live = [s for s in live if outputs[s][-1] not in stop and len(outputs[s]) < max_new]
        return outputs


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp's own prints must not mix with the protocol
    runner = Runner(spec)
    print(json.dumps({"ready": {"version": f"llama-cpp-python {L.__version__}", "model": runner.file}}), file=out,
          flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        b, prompts = req["batch"], req["prompts"]
        stop = set(req.get("stop_token_ids") or ())
        t0 = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), b):
            outputs += runner.generate(prompts[i:i + b], req["max_new_tokens"], stop)
        seconds = time.perf_counter() - t0
        print(json.dumps({"outputs": outputs, "seconds": seconds, "tau": None}), file=out, flush=True)


if __name__ == "__main__":
    main()
