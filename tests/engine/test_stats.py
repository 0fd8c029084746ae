"""Step statistics as vLLM counts them (`SpecDecodingStats`)."""
from flexdraft.engine.stats import IDLE, PREFILL, SpecDecodingStats, StepStats
from flexdraft.speculative.drafts import Mode


def test_counts_follow_vllm_definitions_and_deltas_give_the_counts_between_snapshots():
    """A draft is a row verified by a speculative step; draft tokens are the block verified per row; accepted
    tokens per position j count the rows that accepted draft j. AR, prefill and idle steps count steps and tokens
    only; steps by mode are decoding steps.
    A delta between two snapshots equals the counts of the steps between them."""
    steps = [StepStats("sequential", 3, block=4, accepted=[0, 2, 4], tokens=9),
             StepStats("ar", 2, tokens=2),
             StepStats(IDLE, 0),
             StepStats(PREFILL, 0, admitted=2, tokens=2),
             StepStats("parallel", 2, block=3, accepted=[3, 1], tokens=6)]
    total = SpecDecodingStats()
    total.observe(steps[0])
    snapshot = total.copy()
    for s in steps[1:]:
        total.observe(s)
    assert (total.num_steps, total.num_rows, total.num_tokens) == (5, 7, 19)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (5, 3 * 4 + 2 * 3, 10)
    assert total.num_accepted_tokens_per_pos == [2 + 2, 2 + 1, 1 + 1, 1]
    assert total.steps_by_mode == {Mode.SEQUENTIAL: 1, Mode.AR: 1, Mode.PARALLEL: 1}
    assert total.num_target_forwards == 3 and total.mean_accepted_length == 1 + 10 / 5
    later = total.delta(snapshot)
    assert (later.num_steps, later.num_drafts, later.num_accepted_tokens) == (4, 2, 4)
    assert later.num_accepted_tokens_per_pos == [2, 1, 1, 0] and later.steps_by_mode[Mode.SEQUENTIAL] == 0
    assert snapshot.num_steps == 1  # the snapshot did not move with the totals
