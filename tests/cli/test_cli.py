"""`flexdraft generate`: JSON lines in input order, and one-line errors naming the bad value."""
import json

import pytest

from conftest import write_jsonl
from flexdraft.cli.main import main
from flexdraft.core.data import chat_ids, text_ids
from flexdraft.engine.ar import generate
from flexdraft.speculative.sampling import SamplingParams


@pytest.mark.real_model
def test_generate_json_lines_in_input_order(tmp_path, capsys, real_folder, real_lm):
    """Three prompt kinds in one file, batch size 2: one JSON line each, in order, each row's ids equal to the
    library's greedy output for the prompt's own token ids (text tokenized, chat through the template, ids as
    given), and its text their decoding."""
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "What is 7 times 6?"}]},
        {"prompt_token_ids": [1, 9690, 198, 504, 3458]},
    ])
    assert main(["generate", "--model", str(real_folder), "--prompts-file", str(f), "--json",
                 "--max-new-tokens", "12", "--batch-size", "2", "--dtype", "float32", "--mode", "ar"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2]
    tok = real_lm.tokenizer
    prompts = [text_ids(tok, "The capital of France is"),
               chat_ids(tok, [{"role": "user", "content": "What is 7 times 6?"}]), [1, 9690, 198, 504, 3458]]
    ref = generate(real_lm.model, prompts, SamplingParams(max_new_tokens=12), real_lm.eos_token_ids)
    for r, g in zip(lines, ref):
        assert r["token_ids"] == g.token_ids and r["seconds"] > 0
        assert r["text"] == tok.decode(g.token_ids, skip_special_tokens=True)
    assert "tokens/s" in err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "/nonexistent/model"], "model path not found: /nonexistent/model"),
    (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer, got 0"),
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--mode", "lookup", "--store", "/nonexistent/ngrams.safetensors"], "no n-gram store at /nonexistent/ngrams.safetensors"),
    (["--mode", "lookup", "--proposer", "nope"], "unknown proposer 'nope'"),
    (["--proposer", "suffix={n: 1}"], "--proposer suffix={n: 1}: its settings are not JSON"),
])
def test_bad_input_gives_one_line_error(capsys, argv, needle):
    assert main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexdraft: error: ") and needle in err and err.count("\n") == 1


def test_unreadable_gguf_is_named(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00 not really")
    assert main(["generate", "--prompt", "hi", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read GGUF file {bad}" in err and err.count("\n") == 1


@pytest.mark.real_model
def test_prompt_longer_than_context_is_a_one_line_error(tmp_path, capsys, real_folder, monkeypatch):
    """Checked for every prompt before any generation: nothing half-done is printed. (A home of its own: with this
    machine's default drafter the engine would profile first and say so.)"""
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path / "home"))
    f = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "Hello"}, {"prompt_token_ids": [198] * 9000}])
    assert main(["generate", "--model", str(real_folder), "--prompts-file", str(f), "--batch-size", "1"]) == 2
    out, err = capsys.readouterr()
    assert "prompt 1 has 9000 tokens: longer than the model's context of 8192" in err
    assert err.count("\n") == 1 and out == ""


def test_folder_without_tokenizer_is_named(tmp_path, capsys):
    from conftest import make_tiny_hf

    make_tiny_hf("qwen3", tmp_path)  # weights and config only
    capsys.readouterr()
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no usable tokenizer in {tmp_path}" in err and err.count("\n") == 1


@pytest.mark.real_model
def test_generate_speculative_modes_json(tmp_path, capsys, real_folder, real_lm, monkeypatch):
    """--drafter init (untrained), sequential and parallel: the JSON lines add accepted_lengths and tau and
    the tokens equal AR greedy; without --drafter, with no default drafter, mode defaults to ar (and says
    so) while an explicit speculative mode is a one-line error naming the missing file."""
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path))  # no default drafter here
    ids = [1, 9690, 198, 504, 3458]
    ref = generate(real_lm.model, [ids], SamplingParams(max_new_tokens=10), real_lm.eos_token_ids)[0].token_ids
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": ids}])
    base = ["generate", "--model", str(real_folder), "--prompts-file", str(f), "--json", "--max-new-tokens", "10",
            "--dtype", "float32"]
    for mode in ("sequential", "parallel"):
        assert main([*base, "--drafter", "init", "--mode", mode, "--block-size", "3"]) == 0
        out, err = capsys.readouterr()
        row = json.loads(out)
        assert row["token_ids"] == ref and row["mode"] == mode
        assert row["tau"] >= 1 and all(0 <= a <= 3 for a in row["accepted_lengths"])
        assert "[drafter: init; mode " + mode in err
    # a draft source from a test file, by import path (tests/plugins/proposer_plugin), alone in lookup mode
    plugin = 'proposer_plugin:SuffixProposer={"n": 1}'
    assert main([*base, "--mode", "lookup", "--lookup", "0", "--proposer", plugin]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ref
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["token_ids"] == ref and "no drafter" in err and "mode ar" in err
    assert main([*base, "--mode", "adaptive"]) == 2
    err = capsys.readouterr().err
    assert "no drafter given and the default one" in err and str(tmp_path) in err and err.count("\n") == 1

