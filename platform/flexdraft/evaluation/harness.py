"""The benchmark harness (`flexdraft bench --config ...`): datasets x batch sizes x methods on the same prompts
in the same run, every FlexDraft output checked against our AR, results as Markdown, JSON, plots and MLflow.

Methods (`METHODS`): our AR (the reference), `transformers` generate and prompt-lookup decoding on the same
weights, the peers a user would run instead (vLLM for CPU, opt-in: `evaluation.peers`), and the engine's modes,
three of which form the ablation (attention tuning only -> + calibration -> + selective verification). The engine
methods decode in lockstep, one step of each in turn (in a new random order each round), so this noisy machine's
bursts hit all alike, and `ar-control`, our AR a second time, measures the noise that is left; the `transformers` methods and the peers run whole cells after them in every
repeat. Timing excludes model loading and includes prefill; every cell is warmed up first; a cell's time is the
median over repeats.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flexdraft.core import logs
from flexdraft.core.config import RuntimeConfig, data_dir, from_dict, load_yaml
from flexdraft.core.data import BENCH_DATASETS, UNAVAILABLE_DATASETS, bench_prompts, check_datasets
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.registry import set_tags
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.engine.runner import build_engine, provenance, resolve_drafter, resolve_policy, resolve_store
from flexdraft.engine.stats import NOT_DECODING
from flexdraft.evaluation.bench import hf_generate, load_hf, timed
from flexdraft.evaluation.methods import METHODS, OPT_IN, Method, speculative
from flexdraft.evaluation.peers import PEERS, Peer, peer_python
from flexdraft.evaluation.report import line, noise_floor, plot, report, summary
from flexdraft.models.loading import load_model, source_gguf
from flexdraft.speculative.drafts import Mode
from flexdraft.speculative.grammar import Grammar
from flexdraft.speculative.sampling import SamplingParams

log = logs.get("bench")


@dataclass
class HarnessConfig:
    model: str = "smollm2"
    drafter: str = ""  # "" = the default pipeline's drafter; a folder; models:/NAME/VERSION or models:/NAME@ALIAS; "init"
    store: str = ""  # n-gram store of lookup steps: "" = the default pipeline's (if distilled), a file or folder, "none"
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 where the device has native bf16, else float32 (hardware.probe)
    threads: int = 0  # 0 = one per core
    datasets: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "mt-bench", "math", "mbpp"])
    samples: int = 4  # prompts per dataset; a batch-b cell decodes max(samples, b) of them
    seed: int = 0  # of the prompt sample
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    max_new_tokens: int = 64
    # > 0: every method samples (speculative sampling in the engine, same seed per request); sampled outputs
    # differ from AR's draw for draw, so rows are not compared (the engine tests check the distributions)
    temperature: float = 0.0
    top_p: float = 1.0
    # what every request asks beyond sampling, as a server's clients do (OpenAI's options FlexDraft serves while it
    # speculates): penalties, and a JSON schema the answer must match (response_format json_schema). Every engine
    # method decodes under them; the transformers methods and the peers do not take them and are skipped
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: dict | None = None
    answer_tokens: int = 128  # multi-turn sets: length of the model's own earlier answers (greedy AR)
    repeats: int = 1
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m not in OPT_IN])
    top_m: int = 2  # parallel-pruned keeps this many branches per row
    # EngineConfig settings for every engine method (switch_batch, tree_nodes, rho, lookup, ...; defaults: the
    # engine's); each method's own settings win (its mode, parallel-pruned's top_m)
    engine: dict = field(default_factory=dict)
    # draft sources by name (EngineConfig.proposers: registered, an entry point, or module:attribute) -> settings:
    # each is a method of its own, named as here (lookup steps over its drafts alone, AR where none match)
    proposers: dict = field(default_factory=dict)
    prompt_lookup_tokens: int = 10
    # policy files from `flexdraft sweep`, each an engine method of its own: {method name: file}; a name not in
    # `methods` is added to them (e.g. {tuned: ~/.flexdraft/sweeps/<name>/policy.yaml} beside `adaptive`)
    policies: dict = field(default_factory=dict)
    # the all-branch parallel rows (ablation) run up to this batch size (0 = all): (B+1)^2 branch tokens per row
    # make them ~10x slower than AR at batch 16 on this CPU, minutes per cell that tell nothing new
    all_branches_max_batch: int = 4
    profile: bool = True  # torch profile of 5 parallel-pruned steps at batch 1
    peer_python: str = ""  # the vLLM peer's interpreter ("" = $FLEXDRAFT_VLLM_PYTHON, else ./.venv-vllm/bin/python)
    output_dir: str = ""  # "" = $FLEXDRAFT_HOME/bench/<UTC time>
    mlflow_experiment: str = "flexdraft-bench"

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise FlexDraftError(f"batch_sizes must be >= 1, got {self.batch_sizes}")
        for key in ("samples", "max_new_tokens", "answer_tokens", "repeats", "top_m", "prompt_lookup_tokens"):
            if getattr(self, key) < 1:
                raise FlexDraftError(f"{key} must be >= 1, got {getattr(self, key)}")
        per_method = sorted({"mode", "max_batch", "max_len"} & set(self.engine))
        if per_method:
            raise FlexDraftError(f"engine.{per_method[0]} is set per method and batch size by the harness: remove it")
        from_dict(EngineConfig, self.engine, ".engine")  # unknown keys and wrong types, named
        params = self.params()  # temperature, top_p and penalties checked as the engine will take them
        if params.grammar is not None:
            params.grammar.compiled()  # (an invalid json_schema, named)
        if self.all_branches_max_batch < 0:
            raise FlexDraftError(f"all_branches_max_batch must be >= 0 (0 = no limit), got {self.all_branches_max_batch}")
        clash = sorted((set(self.policies) | set(self.proposers)) & set(METHODS)) or \
            sorted(set(self.policies) & set(self.proposers))
        if clash:
            raise FlexDraftError(f"{clash[0]} names a built-in method, a policy or a proposer twice: name it otherwise")
        self.methods += [name for name in (*self.policies, *self.proposers) if name not in self.methods]
        unknown = [m for m in self.methods if m not in METHODS and m not in self.policies and m not in self.proposers]
        if unknown:
            raise FlexDraftError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)} or name "
                                 "a policy file under `policies`")
        if "ar" not in self.methods:
            self.methods = ["ar", *self.methods]  # speed-ups and correctness are measured against it
        for stack in {PEERS[m].stack for m in self.methods if self.method(m).kind == "peer"}:
            self.python_of(stack)  # each peer's venv named before any work
            if stack == "llama.cpp" and source_gguf(self.model) is None:
                raise FlexDraftError(f"the llama.cpp peer runs a GGUF file and model {self.model} is a HF folder: "
                                     "give the bundled model or a .gguf file")
        check_datasets(self.datasets)
        if not any(d in BENCH_DATASETS for d in self.datasets):
            raise FlexDraftError(f"no available dataset among {self.datasets}: use some of {', '.join(BENCH_DATASETS)}")

    def method(self, name: str) -> Method:
        if name in self.proposers:
            settings = {name: self.proposers[name] or {}}
            return Method("engine", (("mode", "lookup"), ("lookup", 0), ("proposers", settings)),
                          f"the proposer {name}'s drafts alone", store=False)
        if name in self.policies:
            return Method("engine", (("mode", "adaptive"),), f"the policy file {self.policies[name]}",
                          policy=str(self.policies[name]))
        return METHODS[name]

    def python_of(self, stack: str) -> Path:
        """A peer stack's interpreter (`peer_python` is vLLM's; llama.cpp's: $FLEXDRAFT_LLAMA_PYTHON or its venv)."""
        return peer_python(stack, self.peer_python if stack == "vllm" else "")

    def params(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens or self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              grammar=Grammar.json_schema(self.json_schema) if self.json_schema else None)



def cell_work(prompts: int, batch: int, max_new_tokens: int) -> float:
    """A cell's decoding work per method in one-row steps: its batches' steps, a step of b rows (with its share of
    the batch's prefill) weighed as 1 + (b - 1) / 3 one-row steps (configs/bench/demo.yaml on 2 cores: a 16-prompt
    batch-16 cell takes 1.1-1.7x a 4-prompt batch-1 cell). Cells of different batch sizes differ by several times in
    work, so the progress estimate counts this, not cells."""
    return math.ceil(prompts / batch) * max_new_tokens * (1 + (batch - 1) / 3)


def _eta(done: dict[int, tuple[float, float]], left: list[tuple[int, float]]) -> str:
    """", ~N min left" for the cells `left` ((batch, work) each) at the pace measured so far: of cells of the same
    batch size where one ran (done: batch -> (seconds, work)), else of all cells; "" before any ran."""
    if not done:
        return ""
    seconds, work = map(sum, zip(*done.values()))
    pace = {b: s / w for b, (s, w) in done.items()}
    return f", ~{sum(pace.get(b, seconds / work) * w for b, w in left) / 60:.1f} min left"


def load_harness_config(path: str | Path) -> HarnessConfig:
    return load_yaml(HarnessConfig, path)


# ------------------------------------------------------------------------------------------- one cell

def skip_reason(method: str, batch: int, cfg: HarnessConfig) -> str | None:
    if cfg.method(method).kind != "engine" and cfg.temperature > 0:
        return "the transformers methods and the peers run greedy only here"
    if cfg.method(method).kind != "engine" and not cfg.params().plain:
        return "the transformers methods and the peers run without penalties and grammars here"
    if method == "hf-prompt-lookup" and batch > 1:
        return "transformers prompt lookup runs at batch 1 only"  # "assisted generate is only supported for batch_size = 1"
    if method in ("parallel", "parallel-uncalibrated") and 0 < cfg.all_branches_max_batch < batch:
        return f"all-branch parallel runs up to batch {cfg.all_branches_max_batch} (all_branches_max_batch)"
    return None


def _engine(lm, choice, store, cfg: HarnessConfig, method: str, batch: int, max_len: int) -> Engine:
    spec = cfg.method(method)
    overrides = {k: (cfg.top_m if k == "top_m" else v) for k, v in spec.engine}
    ec = from_dict(EngineConfig, {**cfg.engine, "max_batch": batch, "max_len": max_len, **overrides})
    policy = resolve_policy(spec.policy, lm.model, choice) if spec.policy else None
    return build_engine(lm, choice, ec, store if spec.store else None, policy)


def _engines(lm, choice, store, cfg: HarnessConfig, batch: int, max_len: int) -> dict[str, Engine]:
    return {name: _engine(lm, choice, store, cfg, name, batch, max_len) for name in cfg.methods
            if cfg.method(name).kind == "engine" and not skip_reason(name, batch, cfg)}


def lockstep(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams) -> dict[str, dict]:
    """Decode the same prompts with every engine, one step of each in turn, timing each engine's steps only. Each
    round runs the engines in a new (seeded) random order, so none always runs first or right after the same other
    (a cyclic order kept `ar-control` right after `ar` in every round).
    -> per engine: outputs, seconds, forward seconds by kind, steps per plan (mode/B<drafts>/m<branches>),
    steps per mode, accepted drafts per verified row, and per draft position j how often it was verified
    after j-1 accepted drafts and accepted."""
    ids = {name: [e.add_request(p, params) for p in prompts] for name, e in engines.items()}
    res = {name: {"seconds": 0.0, "forward": {}, "plans": {}, "modes": {}, "accepted": [], "pruned": 0,
                  "parallel_rows": 0, "reached": [0] * (e.B + 1), "taken": [0] * (e.B + 1)}
           for name, e in engines.items()}
    order, rng = list(engines), random.Random(0)
    while any(e.has_work() for e in engines.values()):
        rng.shuffle(order)
        for name in order:
            engine = engines[name]
            if not engine.has_work():
                continue
            t0 = time.perf_counter()
            s = engine.step().stats
            r = res[name]
            r["seconds"] += time.perf_counter() - t0
            if s.mode not in NOT_DECODING:  # the shares are of decoding steps
                plan = s.kind + (f"/B{s.block}" if s.block else "") + \
                    (f"/m{s.branches:g}" if s.mode == Mode.PARALLEL else "")
                r["plans"][plan] = r["plans"].get(plan, 0) + 1
                r["modes"][s.kind] = r["modes"].get(s.kind, 0) + 1
            for k, v in s.forward_seconds.items():
                r["forward"][k] = r["forward"].get(k, 0.0) + v
            r["accepted"] += s.accepted
            if s.mode == Mode.PARALLEL:
                r["pruned"] += s.pruned_misses
                r["parallel_rows"] += s.rows
            for a in s.accepted:
                for j in range(1, s.block + 1):
                    if a < j - 1:
                        break
                    r["reached"][j] += 1
                    r["taken"][j] += a >= j
    for name, engine in engines.items():
        gens = [engine.result(i) for i in ids[name]]
        forwards = sum(g.stats.forwards for g in gens)  # target forwards after each row's prefill
        res[name].update(outputs=[g.token_ids for g in gens],
                         tau=(sum(len(g.token_ids) for g in gens) - len(gens)) / max(forwards, 1),
                         misses=res[name]["pruned"] / max(res[name]["parallel_rows"], 1))
    return res


class HFRunner:
    """`transformers` generate over the prompts in static batches of `batch`, counting the model's forwards
    (tau of prompt lookup)."""

    def __init__(self, hf, eos: list[int], pad: int):
        self.hf, self.eos, self.pad, self.forwards = hf, eos, pad, 0
        hf.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    @staticmethod
    def of(lm, runtime: RuntimeConfig) -> HFRunner:
        """Over the `transformers` model of the same weights as `lm`."""
        pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        return HFRunner(load_hf(lm, runtime), list(lm.eos_token_ids), pad)

    def run(self, prompts: list[list[int]], batch: int, max_new: int, lookup: int = 0) -> dict:
        self.forwards, outputs = 0, []

        def generate_all():
            for i in range(0, len(prompts), batch):
                outputs.extend(hf_generate(self.hf, prompts[i:i + batch], max_new, self.pad, self.eos, lookup))

        seconds = timed(generate_all)
        steps = self.forwards - -(-len(prompts) // batch)  # forwards after each batch's prefill
        tokens = sum(len(o) for o in outputs)
        return {"outputs": outputs, "seconds": seconds,
                "tau": (tokens - len(prompts)) / max(steps, 1) if lookup else 1.0}


def run_cell(engines: dict[str, Engine], hf: HFRunner | None, prompts: list[list[int]], batch: int,
             cfg: HarnessConfig, peers: dict[str, Peer] | None = None, eos: list[int] = ()) -> list[dict]:
    """Every method on the same prompts at one batch size -> one result row per method (with peers: each row's
    tokens/s over the best peer's, `speedup_peer`)."""
    params = cfg.params()
    whole = {m: cfg.method(m).kind for m in cfg.methods  # methods that run whole cells, after the lockstep
             if cfg.method(m).kind != "engine" and not skip_reason(m, batch, cfg)}

    def run_whole(name, max_new):
        if whole[name] == "peer":
            return peers[name].run(prompts, batch, max_new, list(eos))
        return hf.run(prompts, batch, max_new, cfg.prompt_lookup_tokens if whole[name] == "hf-lookup" else 0)

    lockstep(engines, prompts[:batch], cfg.params(8))  # warm-up
    for name in whole:
        run_whole(name, 8)
    runs = []
    for _ in range(cfg.repeats):
        run = lockstep(engines, prompts, params)
        run.update({name: run_whole(name, cfg.max_new_tokens) for name in whole})
        runs.append(run)
    median = {name: statistics.median(r[name]["seconds"] for r in runs) for name in runs[0]}
    tok_s = {name: sum(len(o) for o in runs[-1][name]["outputs"]) / median[name] for name in median}
    best_peer = max((tok_s[m] for m, kind in whole.items() if kind == "peer"), default=None)
    reference = runs[0]["ar"]["outputs"]
    rows = []
    for name in cfg.methods:
        if name not in median:
            rows.append({"method": name, "batch": batch, "skipped": skip_reason(name, batch, cfg)})
            continue
        last = runs[-1][name]
        row = {"method": name, "batch": batch, "prompts": len(prompts), "tokens": sum(len(o) for o in last["outputs"]),
               "seconds": median[name], "tok_s": tok_s[name], "speedup_ar": tok_s[name] / tok_s["ar"],
               "speedup_hf": tok_s[name] / tok_s["hf-generate"] if "hf-generate" in tok_s else None,
               "speedup_peer": tok_s[name] / best_peer if best_peer else None,
               "tau": last["tau"],
               # rows whose output differs from our AR's in any repeat (greedy only)
               "mismatched_rows": None if cfg.temperature > 0 else
               sum(any(r[name]["outputs"][i] != ref for r in runs) for i, ref in enumerate(reference))}
        if last.get("acceptance_length") is not None:  # a speculating peer's own measure (not tau: no AR steps)
            row["acceptance_length"] = last["acceptance_length"]
        if cfg.method(name).kind == "engine":
            steps = sum(last["modes"].values())
            split = {k: v / last["seconds"] for k, v in last["forward"].items()}
            split["other"] = 1 - sum(split.values())
            row.update(mode_share={k: v / steps for k, v in last["modes"].items()}, plans=last["plans"],
                       time_split=split, pruned_misses=last["misses"], accepted=last["accepted"],
                       acceptance=[t / r if r else None for t, r in zip(last["taken"][1:], last["reached"][1:])])
        rows.append(row)
    return rows


def step_profile(engine: Engine, prompt: list[int], steps: int = 5, rows: int = 10) -> str:
    """torch.profiler table over `steps` decoding steps of `engine` (after the first two), totals."""
    from torch.profiler import ProfilerActivity, profile

    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=64))
    engine.step()
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.target.device.type == "cuda" else [])
    seconds, forward, plans = 0.0, {}, set()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            s = engine.step().stats
            seconds += s.seconds
            plans.add(f"{s.kind}/B{s.block}/m{s.branches:g}")
            for k, v in s.forward_seconds.items():
                forward[k] = forward.get(k, 0.0) + v
    engine.abort(rid)
    head = (f"{steps} steps ({', '.join(sorted(plans))}), 1 row: {seconds / steps * 1000:.1f} ms per step, "
            "forwards " + ", ".join(f"{k} {v / steps * 1000:.1f} ms" for k, v in forward.items()) +
            " per step (profiler overhead included)")
    return head + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# -------------------------------------------------------------------------------------------- the run

def prompt_ids(lm, cfg: HarnessConfig, datasets: list[str]) -> dict[str, list[list[int]]]:
    """Each dataset's prompt ids (the same for every method; multi-turn sets carry the model's own answers)."""
    n = max(cfg.samples, max(cfg.batch_sizes))
    answer = lambda ps: [g.token_ids for g in generate(  # noqa: E731
        lm.model, ps, SamplingParams(max_new_tokens=cfg.answer_tokens), lm.eos_token_ids)]
    prompts = {}
    for d in datasets:
        prompts[d] = [p.ids for p in bench_prompts(d, lm.tokenizer, n, cfg.seed, answer)]
        log.info(f"{d}: {len(prompts[d])} prompts, {min(map(len, prompts[d]))}-{max(map(len, prompts[d]))} tokens")
    return prompts


def _write_results(results: dict, out: Path, profile: str, run_id: str, version) -> None:
    """results.{json,md} and plots into `out`, logged to the active MLflow run; the mean speed-ups linked to a
    registered drafter's LoggedModel (its page shows them beside its validation tau) and its version tagged."""
    import mlflow

    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report(results) + (f"\n\n## One step, profiled\n\n```\n{profile}\n```\n"
                                                        if profile else ""))
    plot(results, out)
    mean_speedups = {f"mean_speedup_ar.{m}.b{b}": v for m, per in results["summary"].items() for b, v in per.items()}
    mlflow.log_metrics(mean_speedups, model_id=version.model_id if version else None)
    if version is not None:
        set_tags(version, {"bench.last_run": run_id})
    mlflow.log_artifacts(str(out))


def start_peers(lm, cfg: HarnessConfig, max_len: int, stack: contextlib.ExitStack) -> dict[str, Peer]:
    """The config's peer methods, each loaded once in its worker on the same weights (vLLM: the HF folder; llama.cpp:
    the GGUF it came from), dtype and threads (a cold vLLM start compiles for minutes; its log goes to stderr), each
    closed when `stack` closes."""
    names = [m for m in cfg.methods if cfg.method(m).kind == "peer"]
    if not names:
        return {}
    threads = torch.get_num_threads()
    dtype = str(lm.model.dtype).removeprefix("torch.")
    gguf = source_gguf(cfg.model)
    peers = {}
    for name in names:
        python = cfg.python_of(PEERS[name].stack)
        log.info(f"starting the {name} peer ({python}, {dtype}, {threads} thread(s)): minutes when cold")
        peers[name] = stack.enter_context(Peer(name, python, lm.folder, dtype, threads, max_len,
                                               max(cfg.batch_sizes), gguf=gguf, cache_dir=data_dir() / "models"))
    return peers


def _datasets(cfg: HarnessConfig) -> tuple[list[str], dict[str, str]]:
    """-> (the config's datasets that ship, {name: why} of those that do not: not run, nothing substituted)."""
    datasets = check_datasets(cfg.datasets)
    unavailable = {d: UNAVAILABLE_DATASETS[d] for d in cfg.datasets if d in UNAVAILABLE_DATASETS}
    for d, why in unavailable.items():
        log.info(f"{d}: unavailable ({why}); not run, nothing substituted")
    return datasets, unavailable


def run_harness(cfg: HarnessConfig) -> dict:
    """Run every dataset x batch size x method; write results.{json,md} and plots to the output folder and
    log them to MLflow. -> the results dict (also in results.json)."""
    import mlflow

    from flexdraft.core.tracking import git_commit, hardware, start_run

    t_start = time.perf_counter()
    runtime = RuntimeConfig(device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    lm = load_model(cfg.model, runtime)
    choice = resolve_drafter(cfg.drafter or None, lm.model, required=any(map(speculative, cfg.methods)))
    store, store_source = resolve_store(cfg.store or None, cfg.model, lm.model.args.vocab_size)
    hf = HFRunner.of(lm, runtime) if any(cfg.method(m).kind.startswith("hf") for m in cfg.methods) else None
    datasets, unavailable = _datasets(cfg)
    log.info(f"{cfg.model} {str(lm.model.dtype).removeprefix('torch.')} (dtype {cfg.dtype}) on {lm.model.device}, {torch.get_num_threads()} thread(s); drafter "
        f"{choice.source or 'none'}; n-gram store {store_source or 'none'}; {len(datasets)} dataset(s) x batch "
        f"{cfg.batch_sizes} x {len(cfg.methods)} methods")

    prompts = prompt_ids(lm, cfg, datasets)
    B = choice.drafter.config.block_size if choice.drafter is not None else 8  # (lookup alone: 8 drafts)
    max_len = min(lm.model.args.max_position_embeddings,  # (the step profile decodes up to 64 tokens)
                  max(len(p) for ps in prompts.values() for p in ps) + max(cfg.max_new_tokens, 64) + (B + 1) + (B + 1) ** 2)

    out = Path(cfg.output_dir).expanduser() if cfg.output_dir else \
        data_dir() / "bench" / datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows, cells = [], len(cfg.batch_sizes) * len(datasets)
    name = f"bench-{'-'.join(cfg.datasets)}-b{','.join(map(str, cfg.batch_sizes))}"
    with contextlib.ExitStack() as stack, \
            start_run(cfg.mlflow_experiment, {**asdict(cfg), "drafter_source": choice.source}, run_name=name) as run:
        peers = start_peers(lm, cfg, max_len, stack)
        mlflow.set_tags({f"flexdraft.{k}": v for k, v in provenance(choice).items()})
        work = {(b, d): cell_work(len(prompts[d][:max(cfg.samples, b)]), b, cfg.max_new_tokens)
                for b in cfg.batch_sizes for d in datasets}
        done: dict[int, tuple[float, float]] = {}  # batch size -> time in its cells (not building engines), work
        for bi, batch in enumerate(cfg.batch_sizes):
            engines = _engines(lm, choice, store, cfg, batch, max_len)
            for di, d in enumerate(datasets):
                cell, k = prompts[d][:max(cfg.samples, batch)], bi * len(datasets) + di
                eta = _eta(done, [(b, w) for (b, _), w in list(work.items())[k:]])
                log.info(f"{k + 1}/{cells}: {d}, batch {batch}, {len(cell)} prompts, "
                         f"<= {cfg.max_new_tokens} new tokens each{eta}")
                t_cell = time.perf_counter()
                for row in run_cell(engines, hf, cell, batch, cfg, peers, list(lm.eos_token_ids)):
                    row["dataset"] = d
                    rows.append(row)
                    log.info("    " + line(row))
                    if "skipped" not in row:
                        tag = f"{d}.{row['method']}.b{batch}"
                        keys = ("tok_s", "speedup_ar", "speedup_peer", "tau", "mismatched_rows")
                        mlflow.log_metrics({f"{k}.{tag}": row[k] for k in keys if row[k] is not None})
                s, w = done.get(batch, (0.0, 0.0))
                done[batch] = (s + time.perf_counter() - t_cell, w + work[batch, d])
        profile = step_profile(_engine(lm, choice, None, cfg, "parallel-pruned", 1, max_len), prompts[datasets[0]][0]) \
            if cfg.profile and "parallel-pruned" in cfg.methods else ""
        m = lm.model
        results = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   "git_commit": git_commit(), "hardware": hardware(), "config": asdict(cfg), "device": str(m.device),
                   "attention": "math" if m.math_attention else "sdpa", "dtype": str(m.dtype).removeprefix("torch."),
                   "prepacked": m.lm_head.packed is not None, "drafter": choice.source, "drafter_eval": choice.prior,
                   "store": store_source, "unavailable": unavailable, "seconds": time.perf_counter() - t_start,
                   "peers": {n: {"version": p.info["version"], "flags": p.flags} for n, p in peers.items()},
                   "output_dir": str(out), "summary": summary(rows), "vs_peer": summary(rows, "speedup_peer"),
                   "noise_floor": noise_floor(rows), "rows": rows}
        _write_results(results, out, profile, run.info.run_id, choice.version)
        if results["noise_floor"]:
            log.info(f"{results['noise_floor']}")
        log.info(f"done in {results['seconds']:.0f}s: {out}/results.md, results.json, plots; MLflow run "
            f"{run.info.run_id} (experiment {cfg.mlflow_experiment})")
    return results
