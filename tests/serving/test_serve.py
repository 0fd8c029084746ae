"""The Serve app end to end: serve/config.yaml deployed with `serve deploy` to the session's Ray cluster (a tiny
random model with SmolLM2's tokenizer, an untrained drafter, adaptive mode, fp32, an API key), then real HTTP
requests: through the `openai` client the outputs equal AR greedy (text and token-id prompts, streamed or not,
chat); 16 concurrent requests share batches; bad input gets OpenAI-style 4xx bodies and the replica keeps serving;
a client that leaves mid-stream frees its row."""
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ENV, METRICS_PORT, REPO, recorded_pipeline, start_mlflow_server
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.ar import generate
from flexdraft.evaluation.chaos_options import ref_chain, schema
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

SERVE = str(Path(sys.executable).parent / "serve")
URL = "http://127.0.0.1:8000"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 18  # the tiny app's max_body_bytes (a 3,000-$ref schema fits)


def application(name: str, route: str, home: Path, model: Path, tracking: str, **deployment) -> dict:
    """serve/config.yaml's application (imported from the installed package, no working_dir: as `flexdraft serve`
    runs it), renamed and routed, on one of the test's models, its MLflow the `tracking` server; `deployment`
    overrides."""
    cfg = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    app = cfg["applications"][0]
    app.update(name=name, route_prefix=route)
    app["runtime_env"]["env_vars"].update(FLEXDRAFT_HOME=str(home), FLEXDRAFT_API_KEY=KEY,
                                          MLFLOW_TRACKING_URI=tracking)
    d = app["deployments"][0]
    d["ray_actor_options"] = {"num_cpus": 0}  # beside the Ray Train tests' 2 CPUs
    d["user_config"].update(model=str(model), drafter="init", store="none", served_model_name=model.name,
                            runtime={"device": "cpu", "dtype": "float32", "threads": 1}, mlflow_every_s=1)
    d["user_config"]["engine"].update(max_batch=8, max_len=256)
    d["autoscaling_config"].update(deployment.pop("autoscaling_config", {}))
    d["user_config"].update(deployment.pop("user_config", {}))
    d.update(deployment)
    return app


def replicas(app_name: str) -> dict:
    """Serve's replica states of the app's deployment, e.g. {"RUNNING": 2}."""
    from ray import serve

    status = serve.status().applications.get(app_name)
    return dict(status.deployments["FlexDraftServer"].replica_states) if status else {}


@pytest.fixture(scope="module")
def apps(ray_head, real_folder, tiny_smollm2, tiny_pipeline, tmp_path_factory):
    """Three apps of serve/config.yaml in one `serve deploy`, their MLflow a real `mlflow server` (SQLite behind it,
    artifacts proxied: replicas download drafters over HTTP): `tiny` at / (one replica, its drafter registered on
    the server and named by `models:/flexdraft-drafter-tiny@champion`), `elastic` at /elastic (the
    tiny model with 1-2 replicas, 2 requests each, 2 queued, fast autoscaling and health checks), `real` at /real (SmolLM2).
    -> {"tiny": the tiny model (loaded here for reference outputs), "config": the deployed file, "digest": the
    tiny drafter's weights digest as registered, ...}."""
    from flexdraft.drafter.registry import weights_digest
    from flexdraft.training.register import register_drafter

    root, tiny = tmp_path_factory.mktemp("serve"), tiny_smollm2
    home = root / "home"
    server, tracking = start_mlflow_server(f"sqlite:///{root / 'mlflow.db'}", root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXDRAFT_HOME", str(root / "registering"))  # (the replicas' download cache is their own)
        mp.setenv("MLFLOW_TRACKING_URI", tracking)
        source = recorded_pipeline(tiny, root, "tiny", tiny_pipeline[0].distill_dir(), seed=3)
        digest = weights_digest(source.drafter_dir("calibration"))
        version = register_drafter(source)
    assert version == "models:/flexdraft-drafter-tiny/1"
    cfg = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    cfg["applications"] = [
        application("tiny", "/", home, tiny, tracking, autoscaling_config={"min_replicas": 1, "max_replicas": 1},
                    user_config={"max_body_bytes": BODY_LIMIT, "drafter": "models:/flexdraft-drafter-tiny@champion"}),
        application("elastic", "/elastic", home, tiny, tracking, max_ongoing_requests=2, max_queued_requests=2,
                    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                        "upscale_delay_s": 1, "downscale_delay_s": 2,
                                        "look_back_period_s": 11},  # (Ray: > the 10-s default metrics interval)
                    health_check_period_s=1, health_check_timeout_s=5),
        application("real", "/real", home, real_folder, tracking, autoscaling_config={"min_replicas": 1, "max_replicas": 1}),
    ]
    # the tiny app's replicas can import the test-file proposer (`test_a_proposer_from_a_test_file_...` names it):
    # on the nodes' PYTHONPATH, as Ray's docs have it for code outside a runtime_env URI (`serve deploy` takes no
    # local py_modules)
    cfg["applications"][0]["runtime_env"]["env_vars"]["PYTHONPATH"] = str(REPO / "tests" / "plugins")
    cfg["applications"][1]["deployments"][0]["user_config"]["engine"].update(max_batch=2, max_len=512)
    cfg["applications"][1]["runtime_env"]["env_vars"]["FLEXDRAFT_FAULT_INJECTION"] = "1"  # its loop is killed
    cfg["applications"][2]["deployments"][0]["user_config"]["engine"]["cost_model"] = False  # no profiling at start
    (root / "serve.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run([SERVE, "deploy", str(root / "serve.yaml"), "--address", ray_head], env=ENV, check=True,
                   capture_output=True, timeout=120)
    deadline = time.time() + 300
    while True:
        try:
            if all(httpx.get(f"{URL}{r}/health", headers=AUTH, timeout=5).status_code == 200
                   for r in ("", "/elastic", "/real")):
                break
        except httpx.HTTPError:
            pass
        status = subprocess.run([SERVE, "status", "--address", ray_head], env=ENV, capture_output=True, text=True)
        if "DEPLOY_FAILED" in status.stdout or time.time() > deadline:
            pytest.fail(f"the apps did not come up: {status.stdout[-3000:]}")
        time.sleep(2)
    runtime = RuntimeConfig(device="cpu", dtype="float32", threads=1)
    lm = load_model(tiny, runtime)
    lm.home, lm.tracking = home, tracking
    yield {"tiny": lm, "config": root / "serve.yaml", "root": root, "model": tiny, "digest": digest,
           "data": tiny_pipeline[0].distill_dir()}
    subprocess.run([SERVE, "shutdown", "-y", "--address", ray_head], env=ENV, capture_output=True, timeout=120)
    server.terminate()
    server.wait(30)


@pytest.fixture
def app(apps):
    return apps["tiny"]


def greedy(lm, ids: list[int], n: int) -> list[int]:
    return generate(lm.model, [ids], SamplingParams(max_new_tokens=n), lm.eos_token_ids)[0].token_ids


def health() -> dict:
    return httpx.get(f"{URL}/health", headers=AUTH, timeout=10).json()


def test_openai_client_outputs_equal_ar_greedy_streamed_or_not(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{URL}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tok = app.tokenizer
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    ref = greedy(app, ids, 12)
    for prompt in (text, ids):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.token_ids == ref and choice.text == tok.decode(ref, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref)
        assert out.model_extra["flexdraft"]["mean_accepted_length"] >= 1
    off = client.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0,  # per request: no drafts
                                    extra_body={"return_token_ids": True, "flexdraft": {"speculation": False}})
    assert off.choices[0].token_ids == ref and off.model_extra["flexdraft"]["mode_share"] == {"ar": 1.0}
    chunks = list(client.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(ref, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(ref) and chunks[-2].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Say hello."}]
    ref = greedy(app, chat_ids(tok, messages), 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content
    # what newer SDKs and agent frameworks send: a developer message (templated as system) and OpenAI's metadata
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    ref = greedy(app, chat_ids(tok, messages), 10)
    out = client.chat.completions.create(model="tiny", max_completion_tokens=10, temperature=0, store=False,
                                         metadata={"team": "search"}, service_tier="auto", parallel_tool_calls=False,
                                         messages=[{**messages[0], "role": "developer"}, messages[1]])
    assert out.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)


def engine_reference(lm, ids: list[int], params: SamplingParams):
    """The same request through a local AR engine on the same weights (no drafts: the plain decoding)."""
    from flexdraft.engine.config import EngineConfig
    from flexdraft.engine.engine import Engine
    from flexdraft.speculative.grammar import Grammars

    engine = Engine(lm.model, None, EngineConfig(mode="ar", max_batch=1, max_len=256), eos_token_ids=lm.eos_token_ids,
                    grammars=Grammars(lm.tokenizer, lm.model.args.vocab_size))
    return engine.generate([ids], params)[0]


def test_logprobs_and_penalties_through_openai_clients_are_the_plain_decodings(app):
    """While the replica speculates: chat logprobs with top_logprobs and completions logprobs, streamed or not, in
    OpenAI's shapes (one entry per token; a token's bytes are its text's), with the values of a local AR decoding
    of the same weights (1e-4); penalties and a logit bias give that decoding's tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{URL}/v1", api_key=KEY)
    tok = app.tokenizer
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = chat_ids(tok, messages)
    ref = engine_reference(app, ids, SamplingParams(max_new_tokens=12, logprobs=2))
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(ref.token_ids)
    for entry, lp in zip(content, ref.logprobs):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4) and len(entry.top_logprobs) == 2
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # (greedy: the token is the most likely)
    assert b"".join(bytes(e.bytes) for e in content).decode() == tok.decode(ref.token_ids)
    assert out.model_extra["flexdraft"]["target_forwards"] > 0
    first = ref.token_ids[0]

    text = "The capital of France is"
    ref = engine_reference(app, tok(text)["input_ids"], SamplingParams(max_new_tokens=12, logprobs=1))
    whole = client.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, logprobs=1)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=text, max_tokens=12, temperature=0, logprobs=1, stream=True) if c.choices]
    lps = whole.choices[0].logprobs
    assert lps.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lps.token_logprobs, abs=1e-4)
    assert [x for s in streamed for x in s.text_offset] == lps.text_offset
    assert lps.text_offset[0] == 0 and all(len(d) in (1, 2) for d in lps.top_logprobs)  # top 1 + the token itself

    params = SamplingParams(max_new_tokens=16, presence_penalty=1.2, frequency_penalty=0.8, repetition_penalty=1.3,
                            logit_bias=((first, -100.0),))
    ref = engine_reference(app, ids, params)
    assert ref.token_ids != engine_reference(app, ids, SamplingParams(max_new_tokens=16)).token_ids
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                         presence_penalty=1.2, frequency_penalty=0.8,
                                         logit_bias={str(first): -100},
                                         extra_body={"repetition_penalty": 1.3, "return_token_ids": True})
    assert out.choices[0].token_ids == ref.token_ids


def test_n_choices_share_a_batch_and_best_of_returns_the_most_probable(app):
    """n = 2 greedy chat choices are both the greedy answer (usage counts both); n = 3 sampled choices stream
    interleaved, each index ending once with the tokens its chunks carried; best_of = 4 with n = 2 returns the two
    of highest total log-probability, best first, and usage counts all four."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{URL}/v1", api_key=KEY)
    tok = app.tokenizer
    messages = [{"role": "user", "content": "Name a fruit."}]
    ref = greedy(app, chat_ids(tok, messages), 8)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert {c.message.content for c in out.choices} == {tok.decode(ref, skip_special_tokens=True)}
    assert out.usage.completion_tokens == 2 * len(ref)

    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    ids, ends = {0: [], 1: [], 2: []}, []
    for c in chunks:
        for ch in c.choices:
            ids[ch.index] += ch.model_extra["token_ids"]
            ends += [ch.index] if ch.finish_reason else []
    assert sorted(ends) == [0, 1, 2] and chunks[-1].usage.completion_tokens == sum(map(len, ids.values()))
    assert all(ids.values())

    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3,
                                    n=2, best_of=4, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert len(totals) == 2 and totals[0] >= totals[1]
    assert out.usage.completion_tokens > sum(len(c.logprobs.tokens) for c in out.choices)  # (all four counted)


def test_response_format_answers_parse_and_validate_while_speculating(app):
    """json_schema (strict) and json_object through the openai client, greedy and sampled, streamed or not: every
    answer parses and validates against its schema, the greedy one is the local constrained AR decoding's, and the
    replica speculated on them."""
    import jsonschema
    from openai import OpenAI

    from flexdraft.speculative.grammar import Grammar

    client = OpenAI(base_url=f"{URL}/v1", api_key=KEY)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                               "people": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "people"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give a city and a number of people as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    ref = engine_reference(app, chat_ids(app.tokenizer, messages),
                           SamplingParams(max_new_tokens=48, grammar=Grammar.json_schema(schema)))
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                         response_format=fmt, extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == ref.token_ids and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.model_extra["flexdraft"]["target_forwards"] > 0
    for stream in (False, True):  # sampled, two choices each
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=1.0,
                                                seed=11, n=2, response_format=fmt, stream=stream)
        if stream:
            texts = ["", ""]
            for c in answer:
                for ch in c.choices:
                    texts[ch.index] += ch.delta.content or ""
        else:
            texts = [c.message.content for c in answer.choices]
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_langchain_and_litellm_get_what_the_openai_client_gets(app, monkeypatch):
    """LangChain's ChatOpenAI (invoke, stream, logprobs, penalties, n, a developer message and store, JSON mode)
    and LiteLLM's completion (the same calls) against the replica: each answered with the local AR decoding's
    tokens (JSON mode: a JSON object); tools refused by each with a 400 naming the field."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no model cost map from the internet)
    import litellm
    from langchain_core.messages import convert_to_messages
    from langchain_openai import ChatOpenAI

    tok = app.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    ids = chat_ids(tok, messages)
    plain = tok.decode(engine_reference(app, ids, SamplingParams(max_new_tokens=10)).token_ids, skip_special_tokens=True)
    penalised = engine_reference(app, ids, SamplingParams(max_new_tokens=10, presence_penalty=1.5, logprobs=0))
    chat = ChatOpenAI(base_url=f"{URL}/v1", api_key=KEY, model="tiny", temperature=0, max_tokens=10)
    assert chat.invoke(messages).content == plain
    assert "".join(c.content for c in chat.stream(messages)) == plain
    out = chat.bind(logprobs=True, presence_penalty=1.5).invoke(messages)
    assert out.content == tok.decode(penalised.token_ids, skip_special_tokens=True)
    assert [e["logprob"] for e in out.response_metadata["logprobs"]["content"]] == \
        pytest.approx([lp.logprob for lp in penalised.logprobs], abs=1e-4)
    developer = [{**messages[0], "role": "developer"}, messages[1]]
    two = ChatOpenAI(base_url=f"{URL}/v1", api_key=KEY, model="tiny", temperature=0, max_tokens=10, n=2,
                     store=False).generate([convert_to_messages(developer)])
    assert [g.text for g in two.generations[0]] == [plain, plain]
    json_mode = chat.bind(response_format={"type": "json_object"}, max_tokens=40).invoke(messages)
    assert isinstance(json.loads(json_mode.content), dict)

    call = dict(model="openai/tiny", api_base=f"{URL}/v1", api_key=KEY, temperature=0, max_tokens=10)
    out = litellm.completion(messages=developer, store=False, n=2, **call)
    assert [c.message.content for c in out.choices] == [plain, plain]
    out = litellm.completion(messages=messages, response_format={"type": "json_object"}, **{**call, "max_tokens": 40})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = litellm.completion(messages=messages, logprobs=True, top_logprobs=2, presence_penalty=1.5, **call)
    assert out.choices[0].message.content == tok.decode(penalised.token_ids, skip_special_tokens=True)
    assert len(out.choices[0].logprobs["content"]) == len(penalised.token_ids)

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(Exception, match="tools") as err:
        chat.bind_tools(tools).invoke(messages)
    assert getattr(err.value, "status_code", None) == 400
    with pytest.raises(litellm.BadRequestError, match="tools"):
        litellm.completion(messages=messages, tools=tools, **call)


def test_sixteen_concurrent_requests_succeed_in_shared_batches(app):
    prompts = [f"Count to {i}:" for i in range(16)]

    def one(prompt):
        r = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                             "return_token_ids": True})
        return r.status_code, r.json()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, prompts))
    assert [status for status, _ in results] == [200] * 16
    for prompt, (_, body) in zip(prompts, results):
        assert body["choices"][0]["token_ids"] == greedy(app, app.tokenizer(prompt)["input_ids"], 16)
    assert health()["most_rows"] > 1
    # the replica's serving run in MLflow (the apps' server): a point a second, the tokens among them
    from mlflow.tracking import MlflowClient

    client = MlflowClient(app.tracking)
    time.sleep(2)
    run, = client.search_runs([client.get_experiment_by_name("flexdraft-serve").experiment_id], "tags.app = 'tiny'")
    assert run.data.params["engine.mode"] == "adaptive" and run.data.tags["deployment"] == "FlexDraftServer"
    history = client.get_metric_history(run.info.run_id, "serve/tokens_per_s")
    assert len(history) >= 2 and sum(m.value for m in history) > 0


@pytest.mark.parametrize("body,headers,status,param", [
    (b"{not json", AUTH, 400, None),
    ({"prompt": "hi", "max_tokens": "ten"}, AUTH, 400, "max_tokens"),
    ({"model": "gpt-4", "prompt": "hi"}, AUTH, 404, "model"),
    ({"prompt": list(range(3, 303))}, AUTH, 400, "prompt"),  # 300 tokens > the 256-slot cache
    ({"prompt": "hi", "max_tokens": 250}, AUTH, 400, "max_tokens"),  # + verify and branch slots > 256
    ({"prompt": "hi", "max_tokens": 0}, AUTH, 400, "max_tokens"),
    ({"prompt": "hi", "n": 17}, AUTH, 400, "n"),
    ({"prompt": "hi", "logit_bias": {"49152": 1}}, AUTH, 400, "logit_bias"),  # (past the vocabulary: the engine says)
    ({"prompt": "hi", "stop_token_ids": [49152], "min_tokens": 4}, AUTH, 400, "stop_token_ids"),  # (failed 2 steps)
    ({"prompt": "hi", "repetition_penalty": 1e-45}, AUTH, 400, "repetition_penalty"),  # (a NaN distribution)
    ({"prompt": "hi", "response_format": schema(ref_chain(3000))}, AUTH, 400, "response_format"),  # (SIGSEGV)
    ({"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, None),
    ({"prompt": "hi"}, {}, 401, None),
    (b"{not json", {}, 401, None),  # the key is checked before the body is read
    (b"\xff\xfe not utf-8", AUTH, 400, None),
    ({"prompt": "hi", "seed": 2 ** 70}, AUTH, 400, "seed"),
    ({"prompt": "x" * BODY_LIMIT}, AUTH, 413, None),  # past the app's max_body_bytes
], ids=["malformed-json", "wrong-type", "unknown-model", "prompt-too-long", "too-many-tokens", "max-tokens-0",
        "n-past-16", "logit-bias-past-vocabulary", "stop-id-past-vocabulary", "repetition-penalty-underflow",
        "grammar-that-crashes-its-compiler", "bad-key", "no-key", "no-key-malformed", "not-utf8",
        "seed-overflow", "oversized"])
def test_bad_requests_get_openai_errors_and_the_replica_keeps_serving(app, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{URL}/v1/completions", content=content, timeout=30,
                   headers={**headers, "content-type": "application/json", "x-request-id": "req-42"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and r.headers["x-request-id"] == "req-42"
    ok = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-request-id"]


def test_a_chunked_body_past_the_limit_is_refused_before_the_rest_is_sent(app):
    """A client streaming a chunked body (no Content-Length) gets 413 once the replica has read past
    max_body_bytes: the answer arrives while the client is still sending, after at most the limit plus one chunk,
    not after the whole 20 MB."""
    import socket

    chunk, limit, whole = 16 << 10, BODY_LIMIT, 20 << 20
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", 8000), timeout=30) as s:
        s.sendall(head + b"%x\r\n%s\r\n" % (chunk, b'{"prompt": "' + b"x" * (chunk - 12)))
        sent = chunk
        while sent < whole:
            s.settimeout(0.2)  # give the server a moment to answer before the next chunk
            try:
                answer = s.recv(65536)
            except TimeoutError:
                answer = b""
            if answer:
                break
            s.settimeout(30)
            s.sendall(b"%x\r\n%s\r\n" % (chunk, b"x" * chunk))
            sent += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    print(f"413 after {sent} bytes sent (limit {limit}, chunks of {chunk})")
    assert sent <= limit + 2 * chunk  # the limit, the chunk that crossed it, and one the answer was on its way for
    ok = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_every_v1_route_needs_the_key_and_the_openapi_document_is_the_real_schema(app):
    assert httpx.get(f"{URL}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{URL}/v1/models", headers=AUTH, timeout=10).status_code == 200
    schemas = httpx.get(f"{URL}/openapi.json", timeout=10).json()["components"]["schemas"]
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False


def test_a_client_that_disconnects_mid_stream_frees_its_row(app):
    before = health()["aborted"]
    with httpx.stream("POST", f"{URL}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.time() + 30
    while not (health()["aborted"] == before + 1 and health()["running"] == 0) and time.time() < deadline:
        time.sleep(0.2)
    state = health()
    assert state["aborted"] == before + 1 and state["running"] == 0


def _json(children):
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)


ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12), _json, max_leaves=6)
FIELDS = {  # OpenAI's fields with in-range, out-of-range and wrong-typed values
    "max_tokens": st.integers(-2, 24) | st.integers() | ANY,
    "temperature": st.sampled_from([0, 1e-300, 0.7, 1.0]) | st.floats() | ANY,
    "top_p": st.floats(0, 1) | st.floats() | ANY,
    "top_k": st.integers(-2, 50) | st.integers() | ANY,
    "seed": st.integers() | ANY,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | ANY,
    "stream": st.booleans() | ANY,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | ANY,
    "n": st.integers(-1, 20) | ANY,
    "presence_penalty": st.floats(-3, 3) | ANY,
    "logit_bias": st.dictionaries(st.sampled_from(["5", "49151", "49152", "x"]), st.floats(-150, 150)) | ANY,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema"}, {"type": "yaml"}]) | ANY,
    "model": st.sampled_from(["tiny", "gpt-4"]) | ANY,
    "return_token_ids": st.booleans() | ANY,
    "flexdraft": st.fixed_dictionaries({}, optional={"speculation": st.booleans() | ANY,
                                                     "num_speculative_tokens": st.integers(-1, 70) | ANY}) | ANY,
}
PROMPT = st.text(max_size=40) | st.lists(st.integers(-3, 50_000), max_size=10) | ANY
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": st.text(max_size=30) | ANY}), max_size=3) | ANY
VALID_FIELDS = {  # in range: the server must answer 200 (max_tokens always given: short answers, a quick test)
    "temperature": st.sampled_from([0, 1e-300, 0.7, 1.0]),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "seed": st.integers(-(2 ** 63), 2 ** 63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(), "return_token_ids": st.booleans(), "n": st.integers(1, 3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "flexdraft": st.fixed_dictionaries({}, optional={"speculation": st.booleans(),
                                                     "num_speculative_tokens": st.integers(0, 64)}),
}
VALID_PROMPT = st.text(min_size=1, max_size=40) | st.lists(st.integers(3, 40_000), min_size=1, max_size=10)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                                 "content": st.text(min_size=1, max_size=30)}), min_size=1, max_size=3)
VALID = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries({"prompt": VALID_PROMPT, "max_tokens": st.integers(1, 8)},
                                                                  optional=VALID_FIELDS)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": VALID_MESSAGES, "max_tokens": st.integers(1, 8)}, optional=VALID_FIELDS)))
REQUESTS = st.one_of(
    VALID,
    VALID.map(lambda request: (request[0], {**request[1], "model": "gpt-4"})),  # another model's name: 404
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries({"prompt": PROMPT}, optional=FIELDS)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries({"messages": MESSAGES}, optional=FIELDS)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=64)),
    st.tuples(st.just("/v1/completions"), st.dictionaries(st.text(max_size=8), ANY, max_size=4)),
)


def test_generated_and_hostile_requests_and_vanishing_clients_leave_the_replica_as_it_was(app):
    """Property-based, against the running app: whatever hypothesis sends (valid, out of range, wrong types, raw
    bytes, unknown fields; NaN and Infinity as Python's JSON writes them) and whenever the client leaves, the
    answer is 200 or an OpenAI 4xx error body within the timeout, never a 5xx; afterwards no row, waiting request
    or stream is left, the engine never failed, and a greedy request decodes exactly as before; the examples reach
    every outcome. Then `flexdraft loadtest --chaos`'s mix at 8 clients at once: every class tried, none harmed."""
    from flexdraft.evaluation.chaos import run_chaos, settle

    probe = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    before = httpx.post(f"{URL}/v1/completions", headers=AUTH, json=probe, timeout=60).json()["choices"][0]
    failed_before = health()["failed_steps"]
    seen = {}

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=REQUESTS, leave=st.none() | st.none() | st.integers(0, 3))
    def one(request, leave):
        route, body = request
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**AUTH, "content-type": "application/json"}
        with httpx.stream("POST", f"{URL}{route}", content=raw, headers=headers, timeout=60) as r:
            if leave is not None and r.status_code == 200:
                for i, _ in enumerate(r.iter_lines()):  # leave after `leave` lines (0: at the headers)
                    if i >= leave:
                        break
                seen["left"] = seen.get("left", 0) + 1
                return
            r.read()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404, 413), (r.status_code, raw[:200], r.text[:300])
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    one()
    print("generated requests by outcome:", seen)
    assert {200, 400, 404, "left"} <= set(seen), seen  # answered, refused, another model's name, left mid-answer
    state = settle(URL, AUTH)
    assert (state["running"], state["waiting"], state["streams"]) == (0, 0, 0) and state["alive"]
    assert state["failed_steps"] == failed_before
    after = httpx.post(f"{URL}/v1/completions", headers=AUTH, json=probe, timeout=60).json()["choices"][0]
    assert after["token_ids"] == before["token_ids"]
    report = run_chaos(URL, requests=48, concurrency=8, seed=1, api_key=KEY, timeout=60, max_seconds=60,
                       body_limit=BODY_LIMIT)
    print("chaos:", report.as_dict())
    assert report.ok(), report.as_dict()


def test_spec_decode_metrics_reach_prometheus(app):
    """Ray's metrics export serves the replicas' Serve metrics on the node's Prometheus endpoint, under the names
    vLLM users chart (with Ray's `ray_` prefix): the counters have counted the requests so far."""
    httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "Hello", "max_tokens": 16})
    names = ["ray_flexdraft_spec_decode_num_drafts_total", "ray_flexdraft_spec_decode_num_draft_tokens_total",
             "ray_flexdraft_spec_decode_num_accepted_tokens_per_pos_total", "ray_flexdraft_steps_total",
             "ray_flexdraft_generation_tokens_total", "ray_flexdraft_time_to_first_token_seconds_bucket",
             "ray_flexdraft_e2e_request_latency_seconds_count", "ray_flexdraft_batch_size"]
    deadline = time.time() + 60
    while True:
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith("ray_flexdraft_")]
        if all(any(line.startswith(n) for line in lines) for n in names) or time.time() > deadline:
            break
        time.sleep(2)
    for line in lines:  # the scrape, with only the tags that tell its series apart
        if 'application="tiny"' in line and "_bucket" not in line:
            print(line.split("{")[0], ",".join(re.findall(r'(?:mode|position)="\w+"', line)), line.rsplit(" ", 1)[1])
    for name in names:
        assert any(line.startswith(name) for line in lines), name
    drafts = [float(line.rsplit(" ", 1)[1]) for line in lines
              if line.startswith("ray_flexdraft_spec_decode_num_drafts_total") and 'application="tiny"' in line]
    assert sum(drafts) > 0


def test_loadtest_reports_every_level_against_the_app_a_baseline_and_a_compared_app(app, tmp_path, monkeypatch):
    """`flexdraft loadtest` through HTTP: 6 streamed requests at concurrency 1 and 2 to `tiny`, the same to a
    baseline endpoint (`elastic`) and to a compared one (`real`), taking turns in rounds, each turn a pause after the
    one before (a server that stays busy after its turn must not slow the next); all answered, with latencies,
    throughput, the server's accepted length and each one's tok/s ratio to the baseline, in a JSON file and an MLflow
    run. That run names the app and the registered drafter version `tiny` serves (from /v1/models);
    the version's LoggedModel holds the speed-ups and the serving replica's acceptance, its tags the last load test."""
    import mlflow

    from flexdraft.drafter.registry import lookup
    from flexdraft.evaluation import loadtest
    from flexdraft.evaluation.loadtest import rounds, run_loadtest

    monkeypatch.setenv("MLFLOW_TRACKING_URI", app.tracking)  # the apps' server, where their drafter is registered
    monkeypatch.chdir(tmp_path)
    events, sleep, send = [], loadtest.sleep, loadtest.send_level
    monkeypatch.setattr(loadtest, "sleep", lambda s: (events.append(("pause", s)), sleep(s)))
    monkeypatch.setattr(loadtest, "send_level", lambda base, *a: (events.append(("turn", base)), send(base, *a))[1])

    results = run_loadtest(URL, "gsm8k", [1, 2], 6, stream=True, api_key=KEY, max_tokens=8, pause=0.25,
                           output=tmp_path / "lt.json", baseline=f"{URL}/elastic", compare={"real": f"{URL}/real"})
    turns = 3 * (len(rounds(6, 1)) + len(rounds(6, 2)))
    assert [kind for kind, _ in events] == ["turn"] + ["pause", "turn"] * (turns - 1)
    assert {s for kind, s in events if kind == "pause"} == {0.25}
    for r in results.values():
        for x in (r, r["baseline"], r["compare"]["real"]):
            assert x["errors"] == 0 and x["output_tokens"] > 0 and x["tokens_per_s"] > 0
            assert 0 < x["ttft_p50"] <= x["e2e_p50"] and x["mean_accepted_length"] >= 1
        for x in (r, r["compare"]["real"]):
            assert x["speedup"] == pytest.approx(x["tokens_per_s"] / r["baseline"]["tokens_per_s"])
    assert json.loads((tmp_path / "lt.json").read_text())["results"].keys() == {"1", "2"}
    mlflow.set_tracking_uri(app.tracking)
    run, = mlflow.search_runs(experiment_names=["flexdraft-loadtest"], output_format="list")
    for key in ("tokens_per_s", "baseline/tokens_per_s", "speedup", "real/tokens_per_s", "real/speedup"):
        assert [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, key)] == [1, 2]
    v = lookup("models:/flexdraft-drafter-tiny@champion")
    assert run.data.tags["flexdraft.app"] == "tiny" and run.data.tags["flexdraft.drafter_version"] == v.uri
    assert v.tag("loadtest.last_run") == run.info.run_id and v.tag("loadtest.deployment") == "tiny/FlexDraftServer"
    linked = {m.key for m in mlflow.get_logged_model(v.model_id).metrics}
    assert {"loadtest/speedup", "spec_decode/mean_accepted_length"} <= linked, linked
    serving, = mlflow.search_runs(experiment_names=["flexdraft-serve"], filter_string="tags.app = 'tiny'",
                                  output_format="list")
    assert serving.data.tags["flexdraft.drafter_version"] == v.uri
    with pytest.raises(Exception, match="this machine only"):
        run_loadtest("http://10.0.0.1:8000", "gsm8k", [1], 1)
    with pytest.raises(Exception, match="baseline .* is an endpoint already measured"):
        run_loadtest(URL, "gsm8k", [1], 1, baseline=f"{URL}/v1")
    with pytest.raises(Exception, match="name compared endpoints otherwise"):
        run_loadtest(URL, "gsm8k", [1], 1, baseline=f"{URL}/elastic", compare={"baseline": f"{URL}/real"})


def _complete(route: str, max_tokens: int, timeout: float = 120) -> tuple[float, int | str]:
    """One non-streamed request -> (seconds it took, HTTP status or the client's exception name)."""
    t0 = time.perf_counter()
    try:
        status = httpx.post(f"{URL}{route}/v1/completions", headers=AUTH, timeout=timeout,
                            json={"prompt": "Once upon a time", "max_tokens": max_tokens}).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return time.perf_counter() - t0, status


def _load(route: str, clients: int, max_tokens: int, log: list):
    """Start `clients` threads sending requests back to back until the returned event is set; each result is
    appended to `log` as (finish time, seconds, status)."""
    stop = threading.Event()

    def client():
        while not stop.is_set():
            seconds, status = _complete(route, max_tokens)
            log.append((time.time(), seconds, status))
            if status == 503:
                time.sleep(0.2)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return stop, threads


def _wait_replicas(app_name: str, running: int, timeout: float, timeline: list) -> None:
    """Until the app has exactly `running` replicas, all running; each change is appended to `timeline` as
    (time, replica states)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = replicas(app_name)
        if not timeline or timeline[-1][1] != states:
            timeline.append((time.time(), states))
        if states == {"RUNNING": running}:
            return
        time.sleep(0.5)
    pytest.fail(f"{app_name} did not reach {running} running replicas in {timeout} s: {timeline}")


def test_past_max_queued_requests_clients_get_503_at_once(apps):
    """`elastic` holds 2 requests per replica and queues 2 at the router: of 16 concurrent long requests the
    surplus is refused with 503 at once (every refusal is back before the first accepted request has finished:
    ordered by events, not timed), the rest finish with 200, none hangs. (Serve counts a request as queued only
    once the proxy routes it, so a few more than 2 x 2 + 2 may get through.)"""
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: _complete("/elastic", 100, timeout=60), range(16)))
    print("overload (seconds, status):", sorted(results, key=lambda r: r[1]))
    refused = [s for s, status in results if status == 503]
    assert {status for _, status in results} == {200, 503}
    served = [s for s, status in results if status == 200]
    assert len(refused) >= 16 // 2 and max(refused) < min(served)


def test_sustained_load_brings_a_second_replica_up_and_idle_takes_it_down(apps):
    """target_ongoing_requests 1, upscale_delay_s 1, downscale_delay_s 2: 4 clients in a loop -> 2 replicas;
    no load -> 1 again."""
    timeline, log = [], []
    _wait_replicas("elastic", 1, 120, timeline)
    started = time.time()
    stop, threads = _load("/elastic", 4, 40, log)
    try:
        # a replica starting beside 4 busy clients on 2 cores takes 10-60 s to import torch and load the model
        _wait_replicas("elastic", 2, 240, timeline)
    finally:
        stop.set()
        for t in threads:
            t.join()
    stopped = time.time()
    _wait_replicas("elastic", 1, 120, timeline)
    print(f"elastic replicas over time (s, states), load from {started - timeline[0][0]:.1f} to "
          f"{stopped - timeline[0][0]:.1f} s:", [(round(t - timeline[0][0], 1), s) for t, s in timeline])
    assert any(status == 200 for _, _, status in log)


def test_a_killed_replica_is_replaced_and_later_requests_succeed(apps):
    """`ray.kill` of the only replica while it decodes 2 requests: Serve starts a new one; the requests it held end
    (an error status or a retry on the new replica, no client waits for its timeout), and requests sent after the
    replacement all succeed."""
    import ray

    def replica_names() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::elastic#")}

    timeline, log = [], []
    _wait_replicas("elastic", 1, 120, timeline)
    before = replica_names()
    stop, threads = _load("/elastic", 2, 300, log)  # ~2.5 s each
    try:
        time.sleep(0.7)
        killed_at = time.time()
        for name in before:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        deadline = time.time() + 120
        while time.time() < deadline and not any(t - s > killed_at and status == 200 for t, s, status in log):
            time.sleep(0.2)
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    seen = [(t - s - killed_at, t - killed_at, status) for t, s, status in log]
    print("replica killed; clients saw (sent, done, status) in seconds from the kill:",
          [(round(sent, 1), round(done, 1), status) for sent, done, status in seen])
    assert replica_names() - before, "no new replica"
    assert all(status in (200, 500, 502, 503) for _, _, status in seen)  # answered, none timed out
    in_flight = [status for sent, done, status in seen if sent < 0 < done]
    after = [status for sent, done, status in seen if sent > 0]
    assert len(in_flight) == 2 and after and after[-1] == 200


def test_a_replica_whose_engine_loop_died_is_replaced_and_serves_again(apps):
    """The test-only fault hook ends `elastic`'s engine loop as a bug would: /health answers 503 and a request
    gets 503 at once (nobody hangs); Serve's health check fails, the replica is replaced, and the new one serves;
    the dead replica's MLflow serving run ended FAILED."""
    from ray import serve

    url = f"{URL}/elastic"
    _wait_replicas("elastic", 1, 120, [])
    before = httpx.get(f"{url}/health", timeout=10).json()["replica"]
    killed_at = time.time()
    serve.get_app_handle("elastic").inject_fault.remote("loop").result(timeout_s=30)
    dead = httpx.get(f"{url}/health", timeout=10)
    refused = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30, json={"prompt": "hi", "max_tokens": 4})
    assert dead.status_code == 503 and dead.json()["alive"] is False
    assert refused.status_code == 503 and "loop died" in refused.json()["error"]["message"]
    states = []
    while time.time() < killed_at + 240:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            states.append((round(time.time() - killed_at, 1), r.status_code, r.json().get("replica")))
            if r.status_code == 200 and r.json()["replica"] != before:
                break
        except httpx.HTTPError as e:
            states.append((round(time.time() - killed_at, 1), type(e).__name__, None))
        time.sleep(0.5)
    print(f"engine loop killed; /health over time (s, status, replica): {states[::4] + states[-1:]}")
    assert states[-1][1] == 200 and states[-1][2] != before, states
    ok = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200
    from mlflow.tracking import MlflowClient

    client = MlflowClient(apps["tiny"].tracking)
    run, = client.search_runs([client.get_experiment_by_name("flexdraft-serve").experiment_id],
                              f"tags.replica = '{before}'")
    assert run.info.status == "FAILED"


@pytest.mark.real_model
def test_real_smollm2_through_http_equals_its_greedy_output(apps, real_lm, gsm8k_prompts):
    """SmolLM2 served adaptive (drafter `init`): through the `openai` client, streamed or not, the output is the
    model's own greedy output."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{URL}/real/v1", api_key=KEY)
    model = client.models.list().data[0].id
    ids = gsm8k_prompts[0]
    ref = greedy(real_lm, ids, 24)
    out = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == ref
    streamed = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def redeploy(apps, config: dict, ready) -> None:
    """`serve deploy` the apps' config as `config`, then wait until ready() is true (the replica built its engine)."""
    apps["config"].write_text(yaml.safe_dump(config))
    subprocess.run([SERVE, "deploy", str(apps["config"]), "--address", "http://127.0.0.1:8265"], env=ENV,
                   check=True, capture_output=True, timeout=120)
    deadline = time.time() + 120
    while not ready():
        assert time.time() < deadline, "the redeployed app did not come back"
        time.sleep(1)


def test_a_proposer_from_a_test_file_serves_through_the_replica_losslessly(apps):
    """The tiny app redeployed with `engine.proposers` naming tests/plugins/proposer_plugin's SuffixProposer by import
    path (on its runtime_env's PYTHONPATH; no edit to the package) in lookup mode: the replica's answers are AR
    greedy, their `flexdraft` block's mode share names the proposer, and so does the steps metric's mode label;
    then the app goes back to its config."""
    lm, name = apps["tiny"], "proposer_plugin:SuffixProposer"
    original = yaml.safe_load(apps["config"].read_text())
    cfg = yaml.safe_load(apps["config"].read_text())
    cfg["applications"][0]["deployments"][0]["user_config"]["engine"].update(mode="lookup", lookup=0,
                                                                             proposers={name: {"n": 1}})
    card = lambda: httpx.get(f"{URL}/v1/models", headers=AUTH, timeout=60).json()["data"][0]["flexdraft"]  # noqa: E731
    redeploy(apps, cfg, lambda: card().get("proposers") == name)
    assert card()["mode"] == "lookup"
    try:
        ids = lm.tokenizer("one two three one two three one two")["input_ids"]
        r = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": True}).json()
        assert r["choices"][0]["token_ids"] == greedy(lm, ids, 16)
        assert r["flexdraft"]["mode_share"].get(name, 0) > 0, r["flexdraft"]
        deadline = time.time() + 60  # (Ray exports the replica's metrics every few seconds)
        while f'mode="{name}"' not in httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text:
            assert time.time() < deadline, "the steps metric never named the proposer"
            time.sleep(2)
    finally:
        redeploy(apps, original, lambda: "proposers" not in card() and card()["mode"] != "lookup")


def test_a_promoted_version_redeployed_is_what_the_replica_loaded(apps):
    """The replica reports the digest of the drafter bytes it loaded (computed in the replica, not a registry tag):
    version 1's source folder's at first; after version 2 is registered, promoted to champion and the app
    redeployed with the alias pinned to it (as `flexdraft serve --deploy` pins it), version 2's source folder's,
    and the replica still decodes AR's greedy output. (Runs last: the app serves version 2 afterwards.)"""
    from flexdraft.cli.main import main
    from flexdraft.drafter.registry import weights_digest
    from flexdraft.training.register import register_drafter

    def card() -> dict:  # (while the replica builds its new engine, on a loaded machine an answer can take seconds)
        return httpx.get(f"{URL}/v1/models", headers=AUTH, timeout=60).json()["data"][0]["flexdraft"]

    lm = apps["tiny"]
    assert card()["drafter_digest"] == apps["digest"] and card()["drafter_version"].endswith("/1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXDRAFT_HOME", str(apps["root"] / "registering"))
        mp.setenv("MLFLOW_TRACKING_URI", lm.tracking)
        source = recorded_pipeline(apps["model"], apps["root"], "tiny2", apps["data"], seed=4)
        second = weights_digest(source.drafter_dir("calibration"))
        assert register_drafter(source) == "models:/flexdraft-drafter-tiny/2" and second != apps["digest"]
        assert main(["drafters", "promote", "models:/flexdraft-drafter-tiny/2", "--alias", "champion"]) == 0
    cfg = yaml.safe_load(apps["config"].read_text())
    cfg["applications"][0]["deployments"][0]["user_config"]["drafter_version"] = "2"
    apps["config"].write_text(yaml.safe_dump(cfg))
    subprocess.run([SERVE, "deploy", str(apps["config"]), "--address", "http://127.0.0.1:8265"], env=ENV,
                   check=True, capture_output=True, timeout=120)
    deadline = time.time() + 120
    while card().get("drafter_digest") != second:
        assert time.time() < deadline, card()
        time.sleep(1)
    assert card()["drafter_version"].endswith("/2")
    ids = lm.tokenizer("The capital of France is")["input_ids"]
    r = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == greedy(lm, ids, 12)
