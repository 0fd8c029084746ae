"""The serving layer without Ray: AsyncEngine's continuous-batching loop (concurrent requests equal the engine's own
outputs while sharing batches, a caller that leaves frees its row, a refused or failed request fails alone) and
the OpenAI protocol (errors name the field, streamed text equals the whole, stop strings cut it)."""
import asyncio
import time

import pytest

from conftest import make_tiny_hf
from flexdraft.config import RuntimeConfig, from_dict
from flexdraft.drafter import Drafter, DrafterConfig
from flexdraft.engine import Engine
from flexdraft.engine_config import EngineConfig
from flexdraft.errors import FlexDraftError
from flexdraft.generate import SamplingParams
from flexdraft.models.loading import load_model
from flexdraft.openai_api import APIError, TextStream, parse_request
from flexdraft.serving import AsyncEngine, EngineFailed, ServeConfig, apply_live
from test_engine import ragged_prompts


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
    ae = AsyncEngine(engine(parts), on_step=lambda stats, e: rows.append(stats.rows))

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


def test_a_refused_or_failed_request_fails_alone(parts, monkeypatch):
    """A prompt outside the vocabulary is refused before any token; a step that raises ends the requests it was
    decoding with EngineFailed, and the next request is served normally."""
    e = engine(parts)
    ae = AsyncEngine(e)
    params = SamplingParams(max_new_tokens=6)
    good = ragged_prompts(1, seed=2)[0]
    real_verify, calls = e._verify, []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_verify(*args)

    async def main():
        with pytest.raises(FlexDraftError, match="outside the vocabulary"):
            await collect(ae, [10 ** 6], params)
        monkeypatch.setattr(e, "_verify", fail_once)
        with pytest.raises(EngineFailed, match="boom"):
            await collect(ae, good, params)
        return await collect(ae, good, params)

    try:
        tokens, last = asyncio.run(main())
    finally:
        ae.shutdown()
    assert tokens == engine(parts).generate([good], params)[0].token_ids


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
    with pytest.raises(FlexDraftError, match="unknown key"):
        from_dict(ServeConfig, {"engine": {"switch_batc": 1}})


def test_a_policy_in_user_config_owns_its_knobs_and_live_changes_leave_them(parts, tmp_path):
    """user_config.policy: engine keys the policy sets are refused next to it; a live reconfigure changes only
    what the policy does not set (calibrate), never its S or bands."""
    from flexdraft.policy_file import Band, Policy, save_policy

    path = save_policy(Policy(switch_batch=2, bands=[Band(None, "sequential", block=2)]), tmp_path / "p.yaml")
    with pytest.raises(FlexDraftError, match=r"user_config.engine.switch_batch is set by the policy file"):
        from_dict(ServeConfig, {"policy": str(path), "engine": {"switch_batch": 4, "max_batch": 4}})
    model, drafter = parts
    e = Engine(model, drafter, EngineConfig(max_batch=4, max_len=96), policy=Policy(2, [Band(None, "sequential", 2)]))
    live = from_dict(ServeConfig, {"policy": str(path), "engine": {"calibrate": False}})
    assert apply_live(e, live) == {"calibrate": False}
    assert e.config.switch_batch == 2 and e.band(3).mode == "sequential"


@pytest.mark.parametrize("body,chat,status,param", [
    ([1, 2], False, 400, None),
    ({"prompt": "hi", "n": 2}, False, 400, "n"),
    ({"prompt": "hi", "logprobs": 2}, False, 400, "logprobs"),
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
])
@pytest.mark.real_model
def test_bad_requests_get_an_openai_error_naming_the_field(real_lm, body, chat, status, param):
    with pytest.raises(APIError) as err:
        parse_request(body, chat, "smollm2", real_lm.tokenizer, 512, 16)
    assert err.value.status == status and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.real_model
def test_requests_parse_to_the_prompt_ids_the_engine_decodes(real_lm):
    from flexdraft.data import chat_ids

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
