"""The serving layer without Ray: AsyncEngine's continuous-batching loop (concurrent requests equal the engine's own
outputs while sharing batches, a caller that leaves frees its row, a refused or failed request fails alone) and
the OpenAI protocol (errors name the field, streamed text equals the whole, stop strings cut it)."""
import asyncio
import threading
import time

import pytest
import torch

from conftest import make_tiny_hf, ragged_prompts
from flexdraft.core.config import RuntimeConfig, from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.models.loading import load_model
from flexdraft.serving.async_engine import MAX_STRIKES, AsyncEngine, EngineFailed, EngineUnavailable, built_apart
from flexdraft.serving.config import ServeConfig, apply_live
from flexdraft.serving.openai_api import APIError, TextStream, compile_grammar, parse_request
from flexdraft.speculative.sampling import SamplingParams


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_hf("llama", folder)
    model = load_model(folder, RuntimeConfig(device="cpu", dtype="float32", threads=1), with_tokenizer=False).model
    return model, Drafter.from_target(model, DrafterConfig(k=2, block_size=4)).to_runtime(model)


def engine(parts, **kw) -> Engine:
    model, drafter = parts
    return Engine(model, drafter, EngineConfig(**{"mode": "adaptive", "max_batch": 4, "max_len": 96, **kw}))


async def collect(ae: AsyncEngine, prompt, params, delay: float = 0.0):
    await asyncio.sleep(delay)
    tokens, last = [], None
    async for c in ae.generate(prompt, params):
        tokens += c.tokens
        last = c.finished
    return tokens, last


def wait_for(condition, timeout: float = 10.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_concurrent_requests_share_batches_and_equal_the_engines_own_output(parts):
    """12 requests arriving over time into 4 rows: each output equals the same engine's `generate`, the batch was
    full at times and changed size as requests came and went."""
    prompts = ragged_prompts(12, seed=5)
    params = SamplingParams(max_new_tokens=20)
    ref = [g.token_ids for g in engine(parts).generate(prompts, params)]
    rows = []
    ae = AsyncEngine(engine(parts), on_step=lambda out: rows.append(out.stats.rows))

    async def main():
        return await asyncio.gather(*(collect(ae, p, params, 0.005 * i) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        ae.shutdown()
    assert [tokens for tokens, _ in results] == ref
    assert all(last.finish_reason in ("length", "eos") for _, last in results)
    assert max(rows) == 4 and len(set(rows)) > 1


def test_a_caller_that_leaves_frees_its_row_and_others_go_on(parts):
    e = engine(parts)
    ae = AsyncEngine(e)
    params = SamplingParams(max_new_tokens=60)
    prompt, other = ragged_prompts(2, seed=9)

    async def leave_early():
        stream = ae.generate(prompt, params)
        async for _ in stream:
            break
        await stream.aclose()
        return await collect(ae, other, SamplingParams(max_new_tokens=8))

    try:
        tokens, last = asyncio.run(leave_early())
        assert wait_for(lambda: ae.aborted == 1 and not e.has_work())
    finally:
        ae.shutdown()
    assert len(tokens) == 8 and last.finish_reason == "length"


def test_a_refused_request_fails_alone_before_any_token(parts, monkeypatch):
    """A prompt outside the vocabulary is refused with FlexDraftError; so is one the engine rejects with any other
    exception (before this, a non-FlexDraftError in admission ended the engine thread); the loop goes on."""
    e = engine(parts)
    ae = AsyncEngine(e)
    params = SamplingParams(max_new_tokens=6)
    good = ragged_prompts(1, seed=2)[0]
    real_add = e.add_request

    def add(prompt, p=None, group=None):
        if prompt == [7, 7, 7]:
            raise ValueError("a value the engine cannot take")
        return real_add(prompt, p, group)

    monkeypatch.setattr(e, "add_request", add)

    async def main():
        with pytest.raises(FlexDraftError, match="outside the vocabulary"):
            await collect(ae, [10 ** 6], params)
        with pytest.raises(FlexDraftError, match="refused the request: ValueError"):
            await collect(ae, [7, 7, 7], params)
        return await collect(ae, good, params)

    try:
        tokens, last = asyncio.run(main())
        assert ae.alive
    finally:
        ae.shutdown()
    assert tokens == engine(parts).generate([good], params)[0].token_ids


def poison_steps(e: Engine, monkeypatch, poisoned=lambda req: req.params.seed == 666, times: int = 10 ** 9):
    """Make every step of `e` raise while a request matching `poisoned` holds a row (at most `times` times):
    a request the engine cannot decode, as a value that passes validation but not the layers beneath would."""
    real_step, failures = e.step, []

    def step(admit_limit=None):
        out = real_step(admit_limit)
        if len(failures) < times and any(poisoned(r) for r in e.slots):
            failures.append(1)
            raise RuntimeError("poisoned row")
        return out

    monkeypatch.setattr(e, "step", step)
    return failures


@pytest.mark.parametrize("times", [1, 10 ** 9], ids=["transient", "persistent"])
def test_a_failed_step_is_charged_to_the_request_that_causes_it_and_the_others_stay_exact(parts, monkeypatch,
                                                                                           times):
    """8 requests share the batch with one that makes every step raise (persistent) or one step raise once
    (transient). Persistent: only that request ends with EngineFailed. Transient: nobody does. Either way every
    other output equals the engine's own uninterrupted output, and no row, waiting request or stream is left."""
    prompts = ragged_prompts(8, seed=11)
    params = SamplingParams(max_new_tokens=24)
    ref = [g.token_ids for g in engine(parts).generate(prompts, params)]
    e = engine(parts)
    failures = poison_steps(e, monkeypatch, times=times)
    ae = AsyncEngine(e)
    poison = SamplingParams(max_new_tokens=24, temperature=1.0, seed=666)

    async def main():
        return await asyncio.gather(collect(ae, prompts[0], poison, 0.02),
                                    *(collect(ae, p, params, 0.003 * i) for i, p in enumerate(prompts)),
                                    return_exceptions=True)

    try:
        first, *results = asyncio.run(main())
        assert wait_for(lambda: ae.load()["running"] == ae.load()["waiting"] == ae.load()["streams"] == 0)
        assert ae.alive and ae._admit_limit is None
    finally:
        ae.shutdown()
    assert [r[0] for r in results] == ref
    if times == 1:
        assert not isinstance(first, Exception) and len(first[0]) == 24 and ae.charged == 0
    else:
        assert isinstance(first, EngineFailed) and "poisoned row" in str(first) and ae.charged == 1
    assert failures and ae.failed_steps == len(failures)


def fail_inside_a_step(e: Engine, monkeypatch, where: str, after_steps: int = 3) -> list:
    """Make one step of `e` raise part-way (once, after `after_steps` steps): "forward" right after the verify
    forward wrote its keys and values into the cache (nothing drawn or committed yet), "commit" after some rows
    of the step committed their tokens and others not."""
    import flexdraft.engine.state as state

    failures: list = []

    def due() -> bool:
        if failures or e.totals.num_steps < after_steps:
            return False
        failures.append(where)
        return True

    if where == "forward":
        real = e.verifier.target_logits

        def target_logits(tokens, pos, cache, **tree):
            out = real(tokens, pos, cache, **tree)
            if due():
                raise RuntimeError("failed after the verify forward")
            return out

        monkeypatch.setattr(e.verifier, "target_logits", target_logits)
    else:
        real_emit = state.Request.emit

        def emit(req, tokens, logprobs=None):
            if e.slots.index(req) == 2 and e.stats.rows > 2 and due():
                raise RuntimeError("failed while committing")
            return real_emit(req, tokens, logprobs)

        monkeypatch.setattr(state.Request, "emit", emit)
    return failures


@pytest.mark.parametrize("where", ["forward", "commit"])
def test_a_failure_inside_a_step_leaves_every_output_exact(parts, monkeypatch, where):
    """A step fails once part-way: after its verify forward wrote the cache, or after two of its rows committed
    their tokens and before the rest did. The engine recovers the step's requests (rows that committed keep what
    they committed, the cache writes are dropped) and every greedy output equals the uninterrupted one."""
    prompts = ragged_prompts(8, seed=13)
    params = SamplingParams(max_new_tokens=24)
    ref = [g.token_ids for g in engine(parts, mode="sequential").generate(prompts, params)]
    e = engine(parts, mode="sequential")
    failures = fail_inside_a_step(e, monkeypatch, where)
    ae = AsyncEngine(e)

    async def main():
        return await asyncio.gather(*(collect(ae, p, params) for p in prompts))

    try:
        results = asyncio.run(main())
        assert wait_for(lambda: ae.load()["running"] == ae.load()["waiting"] == ae.load()["streams"] == 0)
    finally:
        ae.shutdown()
    assert failures == [where] and ae.failed_steps == 1 and ae.charged == 0
    assert [r[0] for r in results] == ref


def test_a_sampled_request_keeps_its_random_stream_across_a_recovery(parts, monkeypatch):
    """Seeded sampled requests (AR steps: one draw per token, at a prefill as at a step) through a step that fails
    after its forward, before any draw: each request's tokens are the uninterrupted run's, token for token: it
    re-joins with its own generator where that generator stood, not a fresh one."""
    prompts = ragged_prompts(6, seed=17)
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=100 + i) for i in range(len(prompts))]

    def run(fail: bool):
        e = engine(parts, mode="ar")
        failures = fail_inside_a_step(e, monkeypatch, "forward", after_steps=4) if fail else []
        ae = AsyncEngine(e)

        async def main():
            return await asyncio.gather(*(collect(ae, p, sp) for p, sp in zip(prompts, params)))

        try:
            return [r[0] for r in asyncio.run(main())], failures
        finally:
            ae.shutdown()

    ref, _ = run(False)
    out, failures = run(True)
    assert failures == ["forward"] and out == ref
    assert len({tuple(r) for r in ref}) == len(ref)  # (the seeds differ)


def test_callers_that_vanish_at_any_moment_leave_nothing_behind(parts):
    """Callers cancelled while their admission is pending (the engine thread busy: before this, the cancelled
    ticket's set_result raised InvalidStateError and ended the engine thread), right after it, and mid-stream:
    afterwards the engine has no row, waiting request or stream, and a greedy request decodes as before."""
    e = engine(parts)
    ae = AsyncEngine(e)
    params = SamplingParams(max_new_tokens=40)
    prompts = ragged_prompts(12, seed=3)
    good = SamplingParams(max_new_tokens=10)
    ref = engine(parts).generate([prompts[0]], good)[0].token_ids

    async def main():
        busy = asyncio.get_running_loop().run_in_executor(None, ae.call, lambda eng: time.sleep(0.3))
        await asyncio.sleep(0.05)  # the engine thread is now inside the call: adds wait in the command queue
        pending = [asyncio.create_task(collect(ae, p, params)) for p in prompts[:4]]
        await asyncio.sleep(0.05)
        for t in pending:
            t.cancel()  # while awaiting admission
        await busy
        later = [asyncio.create_task(collect(ae, p, params)) for p in prompts[4:]]
        for i, t in enumerate(later):
            await asyncio.sleep(0.01 * i)  # after admission, mid-stream
            t.cancel()
        await asyncio.gather(*pending, *later, return_exceptions=True)
        return await collect(ae, prompts[0], good)

    try:
        tokens, _ = asyncio.run(main())
        assert wait_for(lambda: (e.active, len(e.waiting), ae.load()["streams"]) == (0, 0, 0))
        assert ae.alive
    finally:
        ae.shutdown()
    assert tokens == ref


def test_a_dead_loop_says_so_and_nobody_waits_for_it(parts):
    """If the loop itself ends (a bug: injected here), `alive` and the load say so, callers decoding or waiting for
    admission get EngineUnavailable at once, and so do new ones and calls."""
    ae = AsyncEngine(engine(parts, max_len=256))
    params = SamplingParams(max_new_tokens=200)
    prompts = ragged_prompts(6, seed=4)

    async def main():
        tasks = [asyncio.create_task(collect(ae, p, params)) for p in prompts]
        await asyncio.sleep(0.1)
        ae.inject_fault("loop")
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineUnavailable) for r in results), results
    assert not ae.alive and not ae.load()["alive"] and "injected loop fault" in ae.death
    with pytest.raises(EngineUnavailable, match="loop died"):
        asyncio.run(collect(ae, prompts[0], params))
    with pytest.raises(EngineUnavailable):
        ae.call(lambda eng: None)


def test_steps_that_fail_before_any_request_is_in_them_end_the_loop(parts, monkeypatch):
    """A step that raises before it admits or decodes anything (the engine itself broken, not a request) has no
    request to charge: after MAX_STRIKES such steps in a row the loop ends, says why, and the waiting callers get
    EngineUnavailable, where before it retried for ever (its failures piling up in the log)."""
    e = engine(parts)
    calls = []

    def broken(admit_limit=None):
        calls.append(admit_limit)
        raise RuntimeError("the engine is broken")

    monkeypatch.setattr(e, "step", broken)
    ae = AsyncEngine(e)
    params = SamplingParams(max_new_tokens=8)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(ae, p, params) for p in ragged_prompts(3, seed=2)),
                                                     return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineUnavailable) for r in results), results
    assert not ae.alive and "EngineBroken" in ae.death and "the engine is broken" in ae.death
    assert len(calls) == MAX_STRIKES and ae.failed_steps == MAX_STRIKES


def test_calls_time_out_and_drain_lets_running_requests_finish(parts):
    """`call` with a timeout does not wait on a busy engine thread (and its function never runs); `drain` takes no
    new requests and lets the running ones finish with their full output."""
    ae = AsyncEngine(engine(parts))
    ran = []
    threading.Thread(target=ae.call, args=(lambda eng: time.sleep(0.5),), daemon=True).start()
    time.sleep(0.1)
    with pytest.raises(TimeoutError):
        ae.call(lambda eng: ran.append(1), timeout=0.1)
    params = SamplingParams(max_new_tokens=30)
    prompts = ragged_prompts(3, seed=8)
    ref = [g.token_ids for g in engine(parts).generate(prompts, params)]

    async def main():
        tasks = [asyncio.create_task(collect(ae, p, params)) for p in prompts]
        await asyncio.sleep(0.05)
        ae.drain(30)
        with pytest.raises(EngineUnavailable, match="replaced by a reconfigure"):
            await collect(ae, prompts[0], params)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == ref and not ran
    assert wait_for(lambda: not ae.alive)


def test_serving_runs_end_with_their_replica_and_silent_ones_are_ended_by_the_next(parts, tmp_path, monkeypatch):
    """A serving run ends FINISHED when its replica stops and FAILED when its engine died; a RUNNING run of the same
    app and deployment without a heartbeat for 3 report intervals (+30 s) is ended KILLED, with the reason, by the
    next replica to start; another app's silent run is not its to end."""
    from mlflow.tracking import MlflowClient

    from flexdraft.serving.mlflow_reporter import ENDED, HEARTBEAT, MlflowReporter

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    client, ae = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), AsyncEngine(engine(parts))
    tags = {"app": "a", "deployment": "FlexDraftServer", "replica": "r1"}
    gone, elsewhere = (MlflowReporter(ae, {}, name, t, every_s=1.0) for name, t in
                       (("r1", tags), ("b1", {**tags, "app": "b", "replica": "b1"})))
    for r in (gone, elsewhere):  # their replicas die: no more reports, nothing ends the runs
        r._stop.set()
        r._thread.join(5)
        client.set_tag(r.run_id, HEARTBEAT, str(int(time.time()) - 40))
    fresh = MlflowReporter(ae, {}, "r2", {**tags, "replica": "r2"}, every_s=1.0)
    assert fresh.ended == [gone.run_id]
    killed = client.get_run(gone.run_id)
    assert killed.info.status == "KILLED" and "ended by r2" in killed.data.tags[ENDED]
    assert client.get_run(elsewhere.run_id).info.status == "RUNNING"
    fresh.stop()
    elsewhere.stop("FAILED")
    assert [client.get_run(r.run_id).info.status for r in (fresh, elsewhere)] == ["FINISHED", "FAILED"]
    ae.shutdown()


def test_live_knobs_change_the_running_engine_and_others_need_a_new_one(parts):
    base = from_dict(ServeConfig, {"engine": {"switch_batch": 4}})
    live = from_dict(ServeConfig, {"engine": {"switch_batch": 1, "top_m": 2}})
    assert not live.needs_new_engine(base)
    assert from_dict(ServeConfig, {"engine": {"max_batch": 8}}).needs_new_engine(base)
    assert from_dict(ServeConfig, {"drafter": "init"}).needs_new_engine(base)
    e = engine(parts)
    ae = AsyncEngine(e)
    try:
        assert ae.call(lambda eng: apply_live(eng, live)) == {"switch_batch": 1, "top_m": 2}
    finally:
        ae.shutdown()
    assert e.config.switch_batch == e.planner.switch_batch == 1 and e.config.top_m == 2
    with pytest.raises(FlexDraftError, match="rho"):  # checked whole before any knob changes
        apply_live(e, from_dict(ServeConfig, {"engine": {"switch_batch": 3, "rho": 0.0}}))
    assert e.config.switch_batch == 1 and e.config.rho > 0
    with pytest.raises(FlexDraftError, match="unknown key"):
        from_dict(ServeConfig, {"engine": {"switch_batc": 1}})


def test_a_policy_in_user_config_owns_its_knobs_and_live_changes_leave_them(parts, tmp_path):
    """user_config.policy: engine keys the policy sets are refused next to it; a live reconfigure changes only
    what the policy does not set (calibrate), never its S or bands."""
    from flexdraft.speculative.policy_file import Band, Policy, save_policy

    path = save_policy(Policy(switch_batch=2, bands=[Band(None, "sequential", block=2)]), tmp_path / "p.yaml")
    with pytest.raises(FlexDraftError, match=r"user_config.engine.switch_batch is set by the policy file"):
        from_dict(ServeConfig, {"policy": str(path), "engine": {"switch_batch": 4, "max_batch": 4}})
    model, drafter = parts
    e = Engine(model, drafter, EngineConfig(max_batch=4, max_len=96), policy=Policy(2, [Band(None, "sequential", 2)]))
    live = from_dict(ServeConfig, {"policy": str(path), "engine": {"calibrate": False}})
    assert apply_live(e, live) == {"calibrate": False}
    assert e.config.switch_batch == 2 and e.band(3).mode == "sequential"


@pytest.fixture(scope="module")
def compiler(real_lm):
    from flexdraft.serving.grammar_compiler import GrammarCompiler
    from flexdraft.speculative.grammar import Grammars

    c = GrammarCompiler(Grammars(real_lm.tokenizer, real_lm.model.args.vocab_size), timeout_s=1.0)
    yield c
    c.close()


@pytest.mark.parametrize("body,chat,status,param", [
    ([1, 2], False, 400, None),
    ({"prompt": "hi", "n": 17}, False, 400, "n"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, False, 400, "best_of"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, False, 400, "best_of"),
    ({"prompt": "hi", "n": 2, "seed": 2 ** 64 - 1}, False, 400, "seed"),  # (choice 1 would take seed + 1)
    ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, True, 400, "best_of"),  # (completions only)
    ({"prompt": "hi", "logprobs": 21}, False, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, False, 400, "logprobs"),  # (completions: an integer; chat: a boolean)
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, True, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, True, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, True, 400,
     "top_logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, False, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": float("nan")}, False, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, False, 400, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {"the": 5}}, False, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, False, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, False, 400, "logit_bias"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 8}, False, 400, "min_tokens"),
    ({"prompt": "hi", "min_tokens": -1}, False, 400, "min_tokens"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, False, 400, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, False, 400, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, False, 400, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, False, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, True, 400, "tools"),
    ({"model": "gpt-4", "prompt": "hi"}, False, 404, "model"),
    ({"prompt": 5}, False, 400, "prompt"),
    ({"prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, False, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10 ** 6}, False, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, False, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, False, 400, "top_p"),
    ({"prompt": "hi", "stop": 3}, False, 400, "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, False, 400, "stream_options"),
    ({"prompt": "hi", "colour": "red"}, False, 400, "colour"),
    ({"messages": []}, True, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, True, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "store": "no"}, True, 400, "store"),
    ({"messages": [{"role": "user", "content": "hi"}], "metadata": {str(i): "v" for i in range(17)}}, True, 400,
     "metadata"),
    ({"prompt": "hi", "store": False}, False, 400, "store"),  # (a chat field: the completions API has none)
    ({"prompt": "hi", "ignore_eos": "yes"}, False, 400, "ignore_eos"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, False, 400, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": list(range(65))}, False, 400, "stop_token_ids"),
    ({"prompt": "hi", "repetition_penalty": 1e-45}, False, 400, "repetition_penalty"),  # its logits overflow to NaN
    ({"prompt": "hi", "repetition_penalty": 0.009}, False, 400, "repetition_penalty"),
    # values of the right JSON type that the layers beneath cannot take
    ({"prompt": "hi", "seed": 2 ** 70}, False, 400, "seed"),  # torch.Generator.manual_seed overflows
    ({"prompt": "hi", "temperature": float("nan")}, False, 400, "temperature"),  # Python's JSON reads NaN
    ({"prompt": "hi", "top_p": float("inf")}, False, 400, "top_p"),
    ({"prompt": "\ud800"}, False, 400, "prompt"),  # a lone surrogate: valid JSON, no tokenizer encodes it
    ({"messages": [{"role": "user", "content": "a\udfff"}]}, True, 400, "messages"),
    ({"prompt": [1, -5]}, False, 400, "prompt"),
    ({"prompt": [1, 2 ** 40]}, False, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": True}, False, 400, "max_tokens"),  # no coercion: true is not 1
    ({"prompt": "hi", "max_tokens": "5"}, False, 400, "max_tokens"),
    ({"prompt": "hi", "top_k": 1.5}, False, 400, "top_k"),
    ({"prompt": "hi", "stop": ["a"] * 5}, False, 400, "stop"),
    ({"prompt": "hi", "stop": ""}, False, 400, "stop"),
    ({"prompt": "hi", "stream": "yes"}, False, 400, "stream"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, True, 400, "messages"),
    ({"messages": [{"role": "user"}]}, True, 400, "messages"),
    ({"prompt": {"nested": ["deep"]}}, False, 400, "prompt"),
    ({}, False, 400, "prompt"),
    ({"prompt": "hi", "flexdraft": {"num_speculative_tokens": -1}}, False, 400, "flexdraft"),
    ({"prompt": "hi", "flexdraft": {"speculate": False}}, False, 400, "flexdraft"),
    ({"prompt": "hi", "flexdraft": {"speculation": "no"}}, False, 400, "flexdraft"),
])
@pytest.mark.real_model
def test_bad_requests_get_an_openai_error_naming_the_field(real_lm, compiler, body, chat, status, param):
    """Parsed and their grammar compiled, as a replica does before the engine sees them."""
    with pytest.raises(APIError) as err:
        compile_grammar(parse_request(body, chat, "smollm2", real_lm.tokenizer, 512, 16), compiler)
    assert err.value.status == status and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def _schema_request(schema: dict):
    return {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.real_model
def test_grammars_that_crash_or_stall_the_compiler_are_a_400_and_the_next_one_compiles(real_lm, compiler):
    """A `$ref` chain that overflows llguidance's stack (SIGSEGV: it killed the replica when compiled in it), a
    schema that compiles past the budget and a `$ref` cycle that matches nothing are each a 400 naming
    response_format; the compiler's child is replaced and the next grammar compiles into what the engine copies."""
    from flexdraft.evaluation.chaos_options import CYCLE, ref_chain, wide
    from flexdraft.speculative.grammar import CompiledGrammar

    crashes, timeouts = compiler.crashes, compiler.timeouts
    for schema, says in ((ref_chain(3000), r"crashed the grammar compiler \(signal 11\)"),
                         (wide(5000), "longer than 1 s to compile"), (CYCLE, "not valid")):
        req = parse_request(_schema_request(schema), False, "smollm2", real_lm.tokenizer, 512, 16)
        with pytest.raises(APIError, match=says) as err:
            compile_grammar(req, compiler)
        assert (err.value.status, err.value.param) == (400, "response_format")
    assert (compiler.crashes - crashes, compiler.timeouts - timeouts) == (1, 1)
    req = parse_request(_schema_request({"type": "object"}), False, "smollm2", real_lm.tokenizer, 512, 16)
    compile_grammar(req, compiler)
    assert isinstance(req.params.grammar, CompiledGrammar)


@pytest.mark.real_model
def test_requests_parse_to_the_prompt_ids_the_engine_decodes(real_lm):
    from flexdraft.core.data import chat_ids

    tok = real_lm.tokenizer
    req = parse_request({"prompt": "The sky is", "max_tokens": 7, "temperature": 0, "stop": "\n"}, False, "m", tok,
                        512, 16)
    assert req.prompt_ids == tok("The sky is")["input_ids"] and req.params.max_new_tokens == 7 and req.params.greedy
    assert parse_request({"prompt": [[5, 6, 7]]}, False, "m", tok, 512, 16).prompt_ids == [5, 6, 7]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    req = parse_request({"messages": messages, "stream": True, "stream_options": {"include_usage": True}}, True,
                        "m", tok, 512, 16)
    assert req.prompt_ids == chat_ids(tok, [{"role": "user", "content": "Hi"}]) and req.stream and req.include_usage
    assert req.params.max_new_tokens == 16 and req.params.temperature == 1.0  # OpenAI's defaults: server's, 1
    caps = [parse_request({"prompt": "hi", **extra}, False, "m", tok, 512, 16).params.max_draft_tokens for extra in
            ({}, {"flexdraft": {"speculation": False}}, {"flexdraft": {"num_speculative_tokens": 2}},
             {"flexdraft": {"speculation": False, "num_speculative_tokens": 2}})]
    assert caps == [None, 0, 2, 0]  # the flexdraft extension -> the engine's per-request draft cap
    req = parse_request({"prompt": "hi", "ignore_eos": True, "stop_token_ids": [7, 9]}, False, "m", tok, 512, 16)
    assert req.params.ignore_eos and req.params.stop_token_ids == (7, 9)  # vLLM's extensions -> the engine's
    req = parse_request({"prompt": "hi", "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                         "repetition_penalty": 1.2, "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3}, False, "m",
                        tok, 512, 16)
    p = req.params
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == \
        (2, 0.5, -0.5, 1.2, 3) and p.logit_bias == ((7, -100.0), (9, 2.5))
    chat = {"messages": messages, "logprobs": True}
    assert parse_request(chat, True, "m", tok, 512, 16).params.logprobs == 0  # the token's own logprob only
    assert parse_request(chat | {"top_logprobs": 4}, True, "m", tok, 512, 16).params.logprobs == 4
    assert parse_request({"messages": messages}, True, "m", tok, 512, 16).params.logprobs is None


@pytest.mark.real_model
def test_a_developer_message_is_a_system_message_and_openai_metadata_changes_nothing(real_lm):
    """What OpenAI's newer SDKs and agent frameworks send: a `developer` message is templated as `system`, and
    store / metadata / service_tier / parallel_tool_calls / prompt_cache_key / safety_identifier are accepted and
    leave the request exactly as it was."""
    tok = real_lm.tokenizer

    def parse(role, **extra):
        body = {"messages": [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
                "temperature": 0, "max_completion_tokens": 9, **extra}
        return parse_request(body, True, "m", tok, 512, 16)

    system = parse("system")
    assert system.prompt_ids != parse("user").prompt_ids  # (the role reaches the template)
    developer = parse("developer", store=False, metadata={"team": "search"}, service_tier="auto",
                      parallel_tool_calls=False, prompt_cache_key="k1", safety_identifier="u1")
    assert developer.prompt_ids == system.prompt_ids and developer.params == system.params


@pytest.mark.real_model
def test_a_temperature_below_epsilon_decodes_greedily(real_lm):
    """temperature 1e-300 passes the schema; dividing logits by it would give inf/NaN, so it decodes greedily."""
    req = parse_request({"prompt": "hi", "temperature": 1e-300}, False, "m", real_lm.tokenizer, 512, 16)
    assert req.params.greedy
    with pytest.raises(FlexDraftError, match="finite"):
        SamplingParams(temperature=float("nan"))


def test_streamed_text_is_decoded_incrementally():
    """Each chunk decodes a few tokens of context and the new ones, not the whole output again (it was O(n^2))."""
    class Counting:
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return "".join(chr(97 + i % 26) for i in ids)

    stream = TextStream(Counting(), [])
    text = "".join(stream.add([i]) for i in range(2000))
    assert text == "".join(chr(97 + i % 26) for i in range(2000))
    assert Counting.decoded < 2000 * 2 * (TextStream.CONTEXT + 2)


@pytest.mark.real_model
def test_streamed_text_equals_the_whole_and_stops_before_a_stop_string(real_lm):
    tok = real_lm.tokenizer
    text = "Café ünïcode — 3 + 4 = 7.\nNext line 🙂 done"
    ids = tok(text)["input_ids"]
    stream = TextStream(tok, [])
    assert "".join(stream.add([t]) for t in ids) + stream.add([], final=True) == tok.decode(ids)
    stream = TextStream(tok, ["\nNext"])
    pieces = [stream.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids).split("\nNext")[0] and stream.stopped


def test_serving_beyond_loopback_fails_closed_without_an_api_key(monkeypatch, capsys):
    """A replica (check_exposure) and `flexdraft serve` refuse a non-loopback or unknown address without a key,
    unless told `insecure`; loopback, a key, or insecure pass."""
    from flexdraft.cli.main import main
    from flexdraft.serving.config import check_exposure

    cfg, insecure = ServeConfig(), ServeConfig(insecure=True)
    for host in ("0.0.0.0", "10.1.2.3", None):
        with pytest.raises(FlexDraftError, match="without an API key"):
            check_exposure(cfg, host, {})
        check_exposure(cfg, host, {"FLEXDRAFT_API_KEY": "k"})
        check_exposure(insecure, host, {})
    check_exposure(cfg, "127.0.0.1", {})
    monkeypatch.delenv("FLEXDRAFT_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # before Ray starts (it would exec `serve run` otherwise)
    assert "refusing to serve on 0.0.0.0 without an API key" in capsys.readouterr().err


@pytest.mark.parametrize("given,expected", [(None, "0"), ("7", "7")])
def test_a_local_serve_run_starts_its_replica_at_normal_cpu_priority(monkeypatch, tmp_path, given, expected):
    """`flexdraft serve` hands `serve run` RAY_worker_niceness=0, so the Ray it starts runs the replica at the
    priority of any other process (Ray's default, nice 15, let a busy neighbour take the replica's cores), unless the
    caller chose a niceness."""
    import os

    from flexdraft.cli import serve
    from flexdraft.cli.main import main

    seen = {}

    def supervise(argv, app, grace_s):
        seen.update(argv=argv, niceness=os.environ.get("RAY_worker_niceness"), app=app, grace=grace_s)

    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path))
    if given is None:
        monkeypatch.delenv("RAY_worker_niceness", raising=False)
    else:
        monkeypatch.setenv("RAY_worker_niceness", given)
    monkeypatch.setattr(serve, "supervise", supervise)
    assert main(["serve"]) == 0
    assert seen["argv"][1] == "run" and seen["niceness"] == expected
    assert (seen["app"], seen["grace"]) == ("flexdraft", 30.0)  # (the packaged config's graceful_shutdown_timeout_s)


# stands in for `serve run` where the signals are what is tested: SIGINT ends it after `finish` seconds, as `serve
# run`'s KeyboardInterrupt handler does once Serve has shut down; it says when it is up
FAKE_SERVE_RUN = """
import signal, sys, time
finish = float(sys.argv[1])
def stop(*_):
    time.sleep(finish)
    print("child: shut down", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, stop if finish >= 0 else signal.SIG_IGN)
print("child: up", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_drains_the_app_then_stops_serve_run_and_exits_0_with_one_line(tmp_path, monkeypatch, capfd,
                                                                                     signum):
    """`flexdraft serve` supervises `serve run`: SIGTERM (docker stop, Kubernetes, systemd) or Ctrl-C deletes the app
    first (`drain`: its replicas finish their in-flight requests), then sends `serve run` SIGINT and returns once it
    has ended (exit 0 from main), saying so in one line; a child that will not stop is killed past the grace period.
    (`flexdraft serve` exec'd `serve run`, whose Ray driver handler exited 15 on SIGTERM, streams cut.)"""
    import os
    import signal
    import subprocess
    import sys

    from flexdraft.cli import serve

    script = tmp_path / "serve_run.py"
    script.write_text(FAKE_SERVE_RUN)
    order = []
    monkeypatch.setattr(serve, "drain", lambda app: order.append(("drain", app)) or True)
    monkeypatch.setattr(serve, "RAY_STOP_S", 3.0)
    me = os.getpid()
    sender = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(2); "
                               f"os.kill({me}, signal.{signum})"])
    serve.supervise([sys.executable, str(script), "0.5"], "flexdraft", 1.0)
    sender.wait()
    out = capfd.readouterr()
    assert order == [("drain", "flexdraft")] and "child: shut down" in out.out
    lines = [line for line in out.err.splitlines() if line.startswith("[serve] stopped")]
    assert len(lines) == 1 and f"stopped on {signum}" in lines[0] and "in-flight requests finished" in lines[0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (its handlers are gone with it)
    sender = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(2); "
                               f"os.kill({me}, signal.SIGTERM)"])
    with pytest.raises(FlexDraftError, match="did not stop within 4 s of SIGTERM: killed"):
        serve.supervise([sys.executable, str(script), "-1"], "flexdraft", 1.0)
    sender.wait()

def test_an_engine_built_apart_leaves_no_thread_behind_and_hands_over_its_thread_count():
    """`built_apart` runs the build on a thread that has ended when it returns (its OpenMP pool gone with it, so the
    engine thread's is the only one), returns what the build returned, takes the thread count the build set, and
    raises what the build raised."""
    seen, before = {}, torch.get_num_threads()

    def build():
        seen["thread"] = threading.current_thread()
        torch.set_num_threads(1)
        torch.ones(4096).cumsum(0)  # (a torch op on the build thread)
        return "engine"

    try:
        assert built_apart(build) == "engine"
        assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

    def fails():
        raise FlexDraftError("no such drafter")

    with pytest.raises(FlexDraftError, match="no such drafter"):
        built_apart(fails)
