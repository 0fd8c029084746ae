"""Self-distillation prompts: real ShareGPT first turns, filtered, deduplicated, never evaluation text."""
from flexdraft.core.config import from_dict
from flexdraft.core.data import EvalOverlap, gsm8k_questions, humaneval_prompts, mtbench_questions, sharegpt_first_turns
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.distill import select_prompts, shards


def test_sharegpt_truncated_file_is_read_to_its_last_complete_conversation():
    """The packaged JSON is cut mid-item: incremental decoding keeps every complete conversation (17,671 items,
    17,397 with a human turn) and stops quietly at the broken one."""
    assert sum(1 for _ in sharegpt_first_turns()) == 17397


def test_eval_overlap_catches_evaluation_text_inside_a_prompt():
    overlap = EvalOverlap()
    q, code, mt = gsm8k_questions(1)[0], humaneval_prompts()[3], mtbench_questions()[5][0]
    assert f"Please help me with this: {q} Thanks!" in overlap
    assert code in overlap and mt.upper() in overlap
    assert "Write a short poem about the sea and the wind at night." not in overlap


def test_selected_prompts_are_unique_bounded_clean_and_deterministic(real_lm):
    cfg = from_dict(PipelineConfig, {"distill": {"num_prompts": 60, "validation_prompts": 6, "shard_size": 16,
                                                 "max_prompt_tokens": 100}})
    prompts = select_prompts(cfg, real_lm.tokenizer)
    assert prompts == select_prompts(cfg, real_lm.tokenizer)
    assert [p["split"] for p in prompts] == ["validation"] * 6 + ["train"] * 54
    assert len({tuple(p["prompt_ids"]) for p in prompts}) == 60
    assert all(8 <= len(p["prompt_ids"]) <= 100 for p in prompts)
    overlap = EvalOverlap()
    assert not any(real_lm.tokenizer.decode(p["prompt_ids"]) in overlap for p in prompts)
    names = [name for name, _ in shards(prompts, 16)]
    assert names == ["validation-00000.parquet", "train-00000.parquet", "train-00001.parquet", "train-00002.parquet",
                     "train-00003.parquet"]  # validation first: a time-boxed distill always has it
