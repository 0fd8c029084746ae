"""The benchmark harness: the dataset registry, and one small real run whose every FlexDraft output equals our
AR's in fp32, with its report, plots and MLflow run."""
import json

import mlflow
import pytest

from conftest import REPO
from flexdraft.cli.main import main
from flexdraft.core.data import BENCH_DATASETS, bench_prompts, check_datasets
from flexdraft.core.errors import FlexDraftError
from flexdraft.evaluation.harness import METHODS, HarnessConfig, run_harness
from flexdraft.evaluation.peers import PEERS, STACKS

OURS = [m for m in METHODS if m not in PEERS]  # every method that runs in this venv
PLUGIN = "proposer_plugin:SuffixProposer"  # tests/plugins/proposer_plugin, outside the package

def test_registry_sizes_and_unavailable_sets():
    """GSM8K test 1,319, HumanEval 164, MT-Bench 80 x 2 turns, ShareGPT's 453 long documents; MATH and MBPP are
    reported, never substituted."""
    sizes = {name: [len(item) for item in d.items()] for name, d in BENCH_DATASETS.items()}
    assert {k: len(v) for k, v in sizes.items()} == {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80,
                                                     "sharegpt-long": 453}
    assert set(sizes["mt-bench"]) == {2} and set(sizes["gsm8k"]) == set(sizes["humaneval"]) == {1}
    assert check_datasets(["gsm8k", "math", "mbpp"]) == ["gsm8k"]
    with pytest.raises(FlexDraftError, match="unknown dataset.*gsm9k"):
        check_datasets(["gsm9k"])
    with pytest.raises(FlexDraftError, match="math is unavailable"):
        bench_prompts("math", None, 2, 0)


def test_seeded_samples_and_mt_bench_second_turn_after_own_answer(real_lm):
    """The same seed gives the same prompts, another seed others; an MT-Bench item gives its two turns in a
    row, the second asked after the model's own first answer."""
    tok = real_lm.tokenizer
    a, b, c = (bench_prompts("gsm8k", tok, 5, seed) for seed in (1, 1, 2))
    assert [p.ids for p in a] == [p.ids for p in b] and [p.ids for p in a] != [p.ids for p in c]
    answers = []

    def answer(prompts):
        answers.append(len(prompts))
        return [tok(f"MY-ANSWER-{i}")["input_ids"] for i in range(len(prompts))]

    mt = bench_prompts("mt-bench", tok, 3, seed=0, answer=answer)
    assert [(p.turn, p.item == mt[0].item) for p in mt] == [(0, True), (1, True), (0, False)]
    assert answers == [2]  # one batched call for the first turns of the two sampled items
    turns = BENCH_DATASETS["mt-bench"].items()[mt[0].item]
    text = tok.decode(mt[1].ids)
    assert text.index(turns[0]) < text.index("MY-ANSWER-0") < text.index(turns[1])
    assert mt[1].ids[:len(mt[0].ids) - 3] == mt[0].ids[:len(mt[0].ids) - 3]  # same conversation, continued


def test_long_documents_are_long_and_fit_a_row_with_room_to_answer(real_lm):
    """Every sharegpt-long prompt (chat template) is at least 500 tokens and leaves 256 of a row's 2,048 cache
    slots for the answer, so a server with default limits takes it."""
    lengths = [len(p.ids) for p in bench_prompts("sharegpt-long", real_lm.tokenizer, 453, seed=0)]
    assert len(lengths) == 453 and min(lengths) >= 500 and max(lengths) <= 2048 - 256


@pytest.mark.parametrize("overrides,needle", [
    ({"methods": ["ar", "medusa"]}, "unknown method(s) medusa"),
    ({"datasets": ["math"]}, "no available dataset"),
    ({"batch_sizes": [0, 4]}, "batch_sizes must be >= 1"),
    ({"samples": 0}, "samples must be >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"methods": ["ar", "vllm"], "peer_python": "/nonexistent/bin/python"}, "run `make peer-vllm`"),
])
def test_bad_harness_config_names_the_problem(tmp_path, capsys, overrides, needle):
    import yaml

    f = tmp_path / "bench.yaml"
    f.write_text(yaml.safe_dump(overrides))
    assert main(["bench", "--config", str(f)]) == 2
    assert needle in capsys.readouterr().err


def test_harness_run_is_lossless_and_complete(tmp_path, mlflow_uri, tiny_smollm2):
    """A tiny model with SmolLM2's tokenizer, fp32, untrained drafter, MT-Bench (two-turn prompts; MATH listed
    too) x batch 1, 2 x every method: every FlexDraft row equals our AR token for token; every cell has a row
    (prompt lookup and the all-branch parallel rows skipped above batch 1, with their reasons); the report names
    the unavailable set; plots and results are logged to MLflow. A proposer defined in a test file (named by its
    import path under `proposers`) is a method of its own, lossless, its steps in its own mode share."""
    cfg = HarnessConfig(model=str(tiny_smollm2), drafter="init", dtype="float32", threads=1,
                        datasets=["mt-bench", "math"], samples=2, batch_sizes=[1, 2], max_new_tokens=8,
                        answer_tokens=8, all_branches_max_batch=1, profile=True, output_dir=str(tmp_path / "out"),
                        methods=list(OURS), proposers={PLUGIN: {}})  # (opt-in methods too)
    results = run_harness(cfg)
    rows = results["rows"]
    assert {(r["dataset"], r["batch"], r["method"]) for r in rows} == {
        ("mt-bench", b, m) for b in (1, 2) for m in (*OURS, PLUGIN)}
    assert all(PLUGIN in r["mode_share"] for r in rows if r["method"] == PLUGIN)
    ran = [r for r in rows if "skipped" not in r]
    skipped = {(r["method"], r["batch"]): r["skipped"] for r in rows if "skipped" in r}
    assert skipped.keys() == {("hf-prompt-lookup", 2), ("parallel", 2), ("parallel-uncalibrated", 2)}
    assert "all_branches_max_batch" in skipped[("parallel", 2)]
    for r in ran:
        assert r["tokens"] > 0 and r["tok_s"] > 0 and r["prompts"] == 2
        if cfg.method(r["method"]).kind == "engine":
            assert r["mismatched_rows"] == 0, r
            assert abs(sum(r["mode_share"].values()) - 1) < 1e-9
        ar = next(a for a in ran if (a["method"], a["batch"], a["dataset"]) == ("ar", r["batch"], r["dataset"]))
        assert r["speedup_ar"] == pytest.approx(r["tok_s"] / ar["tok_s"])  # each row against the same cell's AR
        if r["method"] == "ar-control":  # the noise floor's control: our AR again, so the same tokens
            assert r["tokens"] == ar["tokens"]
    seq = [r for r in ran if r["method"] == "sequential"]
    assert all(len(r["acceptance"]) == 8 and r["tau"] >= 1 for r in seq)

    out = tmp_path / "out"
    saved = json.loads((out / "results.json").read_text())
    assert saved["unavailable"].keys() == {"math"} and saved["summary"]["ar"] == {"1": 1.0, "2": 1.0}
    md = (out / "results.md").read_text()
    assert "math (MATH" in md and "| mt-bench | 2 | adaptive |" in md and "One step, profiled" in md
    assert "Noise floor: `ar-control`" in md and "over 2 cell(s)" in md and "float32 (sdpa attention)" in md
    for png in ("speedup_vs_batch.png", "tau_hist.png", "acceptance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    run = mlflow.search_runs(experiment_names=["flexdraft-bench"], output_format="list")[0]
    assert run.data.metrics["mismatched_rows.mt-bench.parallel-pruned.b2"] == 0
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"results.md", "results.json", "speedup_vs_batch.png", "config.json"} <= names


def test_sampled_harness_run_reports_speed_without_comparing_rows(tmp_path, mlflow_uri, tiny_smollm2):
    """temperature > 0: the engine methods sample (speculative sampling), the transformers methods are skipped
    with the reason, rows are not compared with AR's (mismatched n/a), and the report says how it sampled."""
    cfg = HarnessConfig(model=str(tiny_smollm2), drafter="init", dtype="float32", threads=1, datasets=["gsm8k"],
                        samples=2, batch_sizes=[2], max_new_tokens=8, temperature=0.8, top_p=0.95,
                        methods=["ar", "hf-generate", "lookup", "adaptive"], profile=False,
                        output_dir=str(tmp_path / "out"))
    rows = run_harness(cfg)["rows"]
    assert [r["skipped"] for r in rows if "skipped" in r] == [
        "the transformers methods and the peers run greedy only here"]
    ran = [r for r in rows if "skipped" not in r]
    assert {r["method"] for r in ran} == {"ar", "lookup", "adaptive"}
    assert all(r["mismatched_rows"] is None and r["tokens"] > 0 for r in ran)
    md = (tmp_path / "out" / "results.md").read_text()
    assert "sampled (temperature 0.8, top-p 0.95)" in md and "n/a (sampled)" in md


def test_a_llama_cpp_peer_without_its_venv_or_a_gguf_model_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """`--peers llama.cpp` needs its venv (named: `make peer-llama`) and a model that is a GGUF file (the bundled one
    or a .gguf), not a HF folder: both refused at config time, before a model loads."""
    import sys

    import yaml

    f = tmp_path / "bench.yaml"
    f.write_text(yaml.safe_dump({"methods": ["ar", "llama.cpp"]}))
    monkeypatch.setenv("FLEXDRAFT_LLAMA_PYTHON", str(tmp_path / "nonexistent" / "python"))
    assert main(["bench", "--config", str(f)]) == 2
    assert "run `make peer-llama`" in capsys.readouterr().err
    monkeypatch.setenv("FLEXDRAFT_LLAMA_PYTHON", sys.executable)
    f.write_text(yaml.safe_dump({"methods": ["ar", "llama.cpp"], "model": str(tmp_path)}))
    assert main(["bench", "--config", str(f)]) == 2
    assert "is a HF folder" in capsys.readouterr().err


@pytest.mark.parametrize("stack,imports", [("vllm", {"json", "os", "sys", "time", "vllm"}),
                                           ("llama.cpp", {"ctypes", "json", "os", "sys", "time", "pathlib",
                                                          "llama_cpp", "numpy"})])
def test_peer_workers_import_nothing_of_flexdraft(stack, imports):
    """A peer's worker runs in the peer's venv, where flexdraft is not installed: it imports the standard library
    and its stack only."""
    import ast

    tree = ast.parse(STACKS[stack].worker.read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules == imports


@pytest.mark.peers
def test_vllm_peer_decodes_what_our_ar_decodes(tmp_path, mlflow_uri, real_folder):
    """vLLM (its own venv, `make peer-vllm`) on the same tiny fp32 weights and prompt ids, greedy: its outputs
    equal our AR's row for row at batch 1 and 2, every row has its ratio to the best peer, and the report names
    the peer's version and flags, prefix caching off (the harness repeats its prompts; our engine prefills each
    request). (Head dim 64, as SmolLM2's: vLLM's CPU attention takes no smaller.)"""
    import shutil

    from conftest import make_tiny_hf

    venv = REPO / STACKS["vllm"].venv
    if not (venv / "bin" / "python").is_file():
        pytest.skip("no peer venv: make peer-vllm")
    model = tmp_path / "tiny"
    make_tiny_hf("llama", model, vocab_size=49152, max_position_embeddings=512, hidden_size=128,
                 num_attention_heads=2, num_key_value_heads=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(real_folder / name, model / name)
    cfg = HarnessConfig(model=str(model), dtype="float32", threads=2, datasets=["gsm8k"], samples=2,
                        batch_sizes=[1, 2], max_new_tokens=8, methods=["ar", "vllm"], profile=False,
                        peer_python=str(venv / "bin" / "python"), output_dir=str(tmp_path / "out"))
    rows = run_harness(cfg)["rows"]
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in ("ar", "vllm") for b in (1, 2)}
    for r in rows:
        assert r["mismatched_rows"] == 0 and r["speedup_peer"] > 0 and r["tokens"] > 0, r
    md = (tmp_path / "out" / "results.md").read_text()
    assert "`vllm` (vLLM 0.32.0" in md and "over the best peer" in md
    assert '"enable_prefix_caching": false' in md


@pytest.mark.peers
def test_llama_cpp_peer_decodes_what_our_ar_decodes(tmp_path, mlflow_uri, monkeypatch):
    """llama.cpp (its own venv, `make peer-llama`) on the bundled GGUF, which its own quantize tool turns into fp32
    (our loader dequantises the same file): greedy at batch 1 and 2, its outputs equal our AR's row for row, and the
    report names the peer's version and flags."""
    venv = REPO / STACKS["llama.cpp"].venv
    if not (venv / "bin" / "python").is_file():
        pytest.skip("no peer venv: make peer-llama")
    monkeypatch.setenv(STACKS["llama.cpp"].env, str(venv / "bin" / "python"))
    cfg = HarnessConfig(dtype="float32", threads=2, datasets=["gsm8k"], samples=2, batch_sizes=[1, 2],
                        max_new_tokens=8, methods=["ar", "llama.cpp"], profile=False, output_dir=str(tmp_path / "out"))
    rows = run_harness(cfg)["rows"]
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in ("ar", "llama.cpp") for b in (1, 2)}
    for r in rows:
        assert r["mismatched_rows"] == 0 and r["speedup_peer"] > 0 and r["tokens"] > 0, r
    assert "`llama.cpp` (llama-cpp-python 0.3.36" in (tmp_path / "out" / "results.md").read_text()


def test_the_progress_estimate_prices_each_batch_size_at_its_own_pace():
    """Left cells of a batch size that already ran are priced at that batch size's measured pace, others at the
    pace of all cells so far, in cell_work units (a batch-16 cell of 16 prompts weighs more than a batch-1 cell of
    4); nothing is said before a cell ran."""
    from flexdraft.evaluation.harness import _eta, cell_work

    b1, b16 = cell_work(4, 1, 48), cell_work(16, 16, 48)
    assert b16 > b1
    assert _eta({}, [(1, b1)]) == ""
    # one batch-1 cell took 60 s: another batch-1 cell 60 s, a batch-16 cell at the same pace per unit of work
    assert _eta({1: (60.0, b1)}, [(1, b1), (16, b16)]) == f", ~{(60 + 60 * b16 / b1) / 60:.1f} min left"
    # once a batch-16 cell ran (fast: 10 s), the next one is priced at its pace, not the batch-1 cells'
    assert _eta({1: (120.0, 2 * b1), 16: (10.0, b16)}, [(16, b16)]) == ", ~0.2 min left"
