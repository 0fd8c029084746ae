"""The Serve app end to end: serve/config.yaml deployed with `serve deploy` to the session's Ray cluster (a tiny
random model with SmolLM2's tokenizer, an untrained drafter, adaptive mode, fp32, an API key), then real HTTP
requests: through the `openai` client the outputs equal AR greedy (text and token-id prompts, streamed or not,
chat); 16 concurrent requests share batches; bad input gets OpenAI-style 4xx bodies and the replica keeps serving;
a client that leaves mid-stream frees its row."""
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ENV, REPO, make_tiny_hf
from flexdraft.config import RuntimeConfig
from flexdraft.data import chat_ids
from flexdraft.generate import SamplingParams, generate
from flexdraft.models.loading import load_model

SERVE = str(Path(sys.executable).parent / "serve")
URL = "http://127.0.0.1:8000"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def app(ray_head, real_folder, tmp_path_factory):
    """-> (the served tiny model, loaded here too for reference outputs)."""
    root = tmp_path_factory.mktemp("serve")
    folder = root / "tiny-smollm2-tokenizer"
    make_tiny_hf("llama", folder, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(real_folder / name, folder / name)
    cfg = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    application = cfg["applications"][0]
    application["runtime_env"]["working_dir"] = f"local://{REPO}"  # as `flexdraft serve` does
    application["runtime_env"]["env_vars"].update(FLEXDRAFT_HOME=str(root / "home"), FLEXDRAFT_API_KEY=KEY)
    deployment = application["deployments"][0]
    deployment["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    deployment["ray_actor_options"] = {"num_cpus": 0}  # beside the Ray Train tests' 2 CPUs
    deployment["user_config"].update(model=str(folder), drafter="init", store="none", served_model_name="tiny",
                                     runtime={"device": "cpu", "dtype": "float32", "threads": 1}, mlflow_every_s=1)
    deployment["user_config"]["engine"].update(max_batch=8, max_len=256)
    (root / "serve.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run([SERVE, "deploy", str(root / "serve.yaml"), "--address", ray_head], env=ENV, check=True,
                   capture_output=True, timeout=120)
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(f"{URL}/health", headers=AUTH, timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        status = subprocess.run([SERVE, "status", "--address", ray_head], env=ENV, capture_output=True, text=True)
        if "DEPLOY_FAILED" in status.stdout or time.time() > deadline:
            pytest.fail(f"the app did not come up: {status.stdout[-3000:]}")
        time.sleep(2)
    lm = load_model(folder, RuntimeConfig(device="cpu", dtype="float32", threads=1))
    lm.home = root / "home"
    yield lm
    subprocess.run([SERVE, "shutdown", "-y", "--address", ray_head], env=ENV, capture_output=True, timeout=120)


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
    # the replica's serving run in MLflow (its FLEXDRAFT_HOME's store): a point a second, the tokens among them
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{app.home / 'mlflow.db'}")
    time.sleep(2)
    run, = client.search_runs([client.get_experiment_by_name("flexdraft-serve").experiment_id])
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
    ({"prompt": "hi", "n": 3}, AUTH, 400, "n"),
    ({"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, None),
    ({"prompt": "hi"}, {}, 401, None),
], ids=["malformed-json", "wrong-type", "unknown-model", "prompt-too-long", "too-many-tokens", "max-tokens-0",
        "unsupported-n", "bad-key", "no-key"])
def test_bad_requests_get_openai_errors_and_the_replica_keeps_serving(app, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{URL}/v1/completions", content=content, timeout=30,
                   headers={**headers, "content-type": "application/json", "x-request-id": "req-42"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and r.headers["x-request-id"] == "req-42"
    ok = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-request-id"]


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


def test_loadtest_reports_every_level_against_the_app(app, mlflow_uri, tmp_path):
    """`flexdraft loadtest` through HTTP: 6 streamed requests at concurrency 1 and 3, all answered, with
    latencies, throughput and the server's accepted length, in a JSON file and an MLflow run."""
    import mlflow

    from flexdraft.loadtest import run_loadtest

    results = run_loadtest(URL, "gsm8k", [1, 3], 6, stream=True, api_key=KEY, max_tokens=8,
                           output=tmp_path / "lt.json")
    for r in results.values():
        assert r["errors"] == 0 and r["output_tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["ttft_p50"] <= r["e2e_p50"] and r["mean_accepted_length"] >= 1
    assert json.loads((tmp_path / "lt.json").read_text())["results"].keys() == {"1", "3"}
    run, = mlflow.search_runs(experiment_names=["flexdraft-loadtest"], output_format="list")
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "tokens_per_s")] == [1, 3]
    with pytest.raises(Exception, match="this machine only"):
        run_loadtest("http://10.0.0.1:8000", "gsm8k", [1], 1)
