"""Fair admission: the batch's rows are shared between the groups (clients) that sent the requests, so one client's
many requests or choices cannot keep another's waiting; rows given up for it decode on to the same tokens."""
import pytest

from conftest import ragged_prompts
from engine_fixtures import drafters, tiny, tiny_folder  # noqa: F401 (fixtures)
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.engine.scheduler import schedule
from flexdraft.engine.state import Request
from flexdraft.speculative.sampling import SamplingParams


def requests(groups: str, start: int = 0) -> list[Request]:
    return [Request(start + i, [1], SamplingParams(), None, group=g) for i, g in enumerate(groups)]


def test_rows_go_to_the_group_holding_fewest_and_a_group_holding_none_takes_one_from_the_largest():
    """Each request its own group: FIFO. A waiting group that holds no row while none is free takes the latest row
    of the group holding the most (two or more), one per such group; a group's only row is never taken, nor is
    any row while a server isolates a failure (limit)."""
    plain = requests("abcdef")
    assert schedule(plain[2:], plain[:2], 4, None).admit == plain[2:4]
    running, waiting = requests("AAAA"), requests("AAAbcb", start=4)
    got = schedule(waiting, running, 4, None)
    assert got.preempt == running[3:1:-1] and got.admit == [waiting[3], waiting[4]]  # (b, c: A gave up two)
    got = schedule(waiting, running[:3], 4, None)  # one row free: b takes it, c takes one of A's
    assert got.preempt == [running[2]] and got.admit == [waiting[3], waiting[4]]
    alone = requests("ABCD")
    assert schedule(requests("e", 4), alone, 4, None).preempt == []
    assert schedule(waiting, running, 4, 1) == schedule(waiting, running, 4, 0)  # (no free row, no preemption)
    assert schedule(waiting, running, 4, 1).preempt == []


@pytest.mark.parametrize("mode", ["sequential", "adaptive"])
def test_a_client_holding_no_row_starts_at_the_next_step_and_every_output_stays_exact(tiny, drafters, mode):
    """One client's 8 requests fill a 4-row batch and queue; another client's request is prefilled at the next
    step (a row preempted for it) instead of after the 8. Every output, the preempted ones' included (their
    tokens re-prefilled on readmission), equals AR greedy's alone (fp32)."""
    prompts = ragged_prompts(9, seed=5)
    params = SamplingParams(max_new_tokens=20)
    ref = [generate(tiny, [p], params)[0].token_ids for p in prompts]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode=mode, max_batch=4, max_len=96, switch_batch=2))
    big = [engine.add_request(p, params, group="big") for p in prompts[:8]]
    for _ in range(3):
        engine.step()
    small = engine.add_request(prompts[8], params, group="small")
    out = engine.step()
    assert out.stats.admitted_ids == [small] and out.stats.preempted == 1
    preempted = engine.waiting[0].id
    while engine.has_work():
        engine.step()
    assert [engine.result(i).token_ids for i in [*big, small]] == ref
    assert preempted in big[:4]
