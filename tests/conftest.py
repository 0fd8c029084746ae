import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch

# tests never write to the user's MLflow store; the converted bundled model is shared with ~/.flexdraft
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray 2.60 enables token auth on a local head by default; the Ray job tests then wait forever in Ray Data
# (seen when pytest runs without the Makefile, which exports this too)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# commands run in the test's process with all their output (tests/cli/test_console.py tests the quiet terminal)
os.environ.setdefault("FLEXDRAFT_VERBOSE", "1")
torch.set_num_threads(1)
# draft sources defined outside the package (tests/plugins/proposer_plugin), importable by their import path
sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))


# the test files that use a Ray cluster: they share one `ray start --head` (ray_head) or start Ray nodes of their
# own (the local cluster's, on ports of its own: started beside the others on 2 cores, its nodes time out joining),
# so under pytest-xdist they run on one worker, in order
RAY_FILES = ("test_jobs.py", "test_sweep.py", "test_serve.py", "test_cluster.py")


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers: one takes the Ray files, the other every other module, a module
    at a time (so module fixtures, e.g. a trained tiny drafter, are built once). The Ray files go out first: they
    are the longest unit (most of the suite's wall time), so the other worker runs every other module beside them."""
    from xdist.scheduler import LoadScopeScheduling

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "ray" if Path(path).name in RAY_FILES else path

        def _assign_work_unit(self, node) -> None:
            if "ray" in self.workqueue:
                self.workqueue.move_to_end("ray", last=False)
            super()._assign_work_unit(node)

    return RayApart(config, log)


@pytest.fixture(autouse=True)
def threads(request):
    """Real-model tests decode on every core this test process has to itself (one generating process runs best
    so); the rest on one: tiny models' GEMMs gain nothing from more, and Ray workers beside it take one each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # (pytest-xdist's workers share the cores)
    n = max(1, len(os.sched_getaffinity(0)) // workers) if request.node.get_closest_marker("real_model") else 1
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(1)
# draft sources defined outside the package (tests/plugins/proposer_plugin), importable by their import path
sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))


def make_tiny_hf(arch: str, folder, seed: int = 0, **overrides):
    """A random-initialised `transformers` model of a tiny config, saved as a HF folder (config + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexdraft.models.config import tiny_hf_config

    cfg = tiny_hf_config(arch, **overrides)
    hf_config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    # random init gives near-uniform logits; widen them so greedy decisions are not coin flips
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    hf.save_pretrained(folder)
    return hf


def ragged_prompts(n: int, seed: int = 0, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="session")
def real_folder():
    from flexdraft.models.loading import BUNDLED, resolve_source

    return resolve_source(BUNDLED)


@pytest.fixture(scope="session")
def tiny_smollm2(real_folder, tmp_path_factory):
    """A tiny random llama with SmolLM2's vocabulary, tokenizer and chat template, as a HF folder: the real model's
    text paths (chat prompts, decoding, stop strings) at a tiny model's speed."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-smollm2") / "tiny"
    make_tiny_hf("llama", folder, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(real_folder / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def real_lm(real_folder):
    from flexdraft.core.config import RuntimeConfig
    from flexdraft.models.loading import load_model

    return load_model(real_folder, RuntimeConfig(device="cpu", dtype="float32", threads=0))  # 0: see `threads`


@pytest.fixture(scope="session")
def real_hf(real_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gsm8k_prompts(real_lm):
    from flexdraft.core.data import chat_ids, gsm8k_questions

    return [chat_ids(real_lm.tokenizer, [{"role": "user", "content": q}]) for q in gsm8k_questions(8)]


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory):
    """new_db(folder) -> the URI of a fresh, empty MLflow SQLite store there: a copy of one store whose tables
    were created once per session (MLflow's schema migrations take seconds each time)."""
    import shutil

    from mlflow.tracking import MlflowClient

    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()  # creates the tables

    def new_db(folder) -> str:
        shutil.copyfile(template, folder / "mlflow.db")
        return f"sqlite:///{folder / 'mlflow.db'}"

    return new_db


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch, mlflow_db):
    uri = mlflow_db(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # whatever still writes relative to the cwd lands here, not in the repository
    return uri


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A tiny llama, its 'distilled' data (random sequences in the distill format) and a config."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flexdraft.core.config import from_dict
    from flexdraft.drafter.recipe import PipelineConfig
    from flexdraft.training.distill import write_manifest

    root = tmp_path_factory.mktemp("pipeline")
    make_tiny_hf("llama", root / "model")
    raw = {"name": "tiny", "output_dir": str(root / "out"), "model": str(root / "model"),
           "drafter": {"k": 2, "block_size": 4},
           "distill": {"num_prompts": 24, "validation_prompts": 4},
           "attention": {"steps": 6, "anchors_per_seq": 8, "checkpoint_every": 3, "log_every": 3, "eval_sequences": 4},
           "calibration": {"steps": 1000, "time_budget_min": 0.1, "anchors_per_seq": 8, "checkpoint_every": 4,
                           "log_every": 4, "eval_sequences": 4}}
    cfg = from_dict(PipelineConfig, raw)
    data = cfg.distill_dir()
    data.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 20), ("validation", 4)):
        ids = [torch.randint(3, 96, (int(torch.randint(30, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
        pq.write_table(pa.table({"id": [f"{split}{i}" for i in range(n)], "input_ids": ids, "prompt_len": [8] * n,
                                 "finish_reason": ["length"] * n}), data / f"{split}-00000.parquet")
    write_manifest(data, cfg)  # a finished distill job's folder: reused, never redone
    (root / "tiny.yaml").write_text(json.dumps(raw))  # JSON is YAML
    return cfg, raw, root


def recorded_pipeline(model: Path, root: Path, name: str, data: Path, seed: int):
    """A pipeline's MLflow record without Ray, in the current MLFLOW_TRACKING_URI: each stage's run, drafter (the
    init drafter of k=2, B=4, perturbed by `seed`) and MLflow model logged as `worker.finish` logs them
    (`log_stage_model`), the runs' ids where the trainer keeps them; `register_drafter(cfg)` then registers it."""
    import mlflow

    from flexdraft.core.config import from_dict
    from flexdraft.core.tracking import start_run
    from flexdraft.drafter.model import Drafter, save_drafter
    from flexdraft.drafter.recipe import PipelineConfig
    from flexdraft.models.loading import load_model
    from flexdraft.training.common import run_key
    from flexdraft.training.register import log_stage_model

    cfg = from_dict(PipelineConfig, {"name": name, "output_dir": str(root / name), "model": str(model),
                                     "drafter": {"k": 2, "block_size": 4}})
    cfg.distill_dir().parent.mkdir(parents=True, exist_ok=True)
    if not cfg.distill_dir().exists():
        cfg.distill_dir().symlink_to(data)
    target = load_model(model, with_tokenizer=False).model
    g = torch.Generator().manual_seed(seed)
    drafter = Drafter.from_target(target, cfg.drafter)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    for stage in ("attention", "calibration"):
        with start_run(cfg.mlflow_experiment, {"stage": stage}, run_name=f"{name}-{stage}") as run:
            cfg.root.mkdir(parents=True, exist_ok=True)
            (cfg.root / f"{stage}-{run_key(cfg, stage)}.mlflow-run").write_text(run.info.run_id)
            ev = {"eval/bonus/tau": 1.25 + seed / 100, "eval/mask/tau": 1.1}
            folder = save_drafter(drafter, cfg.drafter_dir(stage), str(model), target.fingerprint,
                                  {"stage": stage, "eval": ev, "steps": 3})
            mlflow.set_tag("flexdraft.model_id", log_stage_model(folder, stage, ev, data))
    return cfg


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
# as a user with the venv activated: the cluster's `python` (which runs submitted jobs) is the venv's
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
       "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


METRICS_PORT = 8089  # the head node's Prometheus endpoint (Ray's metrics export)


@pytest.fixture(scope="session")
def ray_head():
    """One Ray cluster for the session's Ray tests (jobs, Serve), started as a user would (`ray start --head`);
    this process joins it. -> the dashboard address (`ray job submit`, `serve deploy`)."""
    # autoscaling metrics pushed every 0.5 s (Ray 2.60's replacement for AutoscalingConfig.metrics_interval_s),
    # so the autoscaling test's 1-s look-back sees load within seconds
    fast = {f"RAY_SERVE_{side}_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5" for side in ("REPLICA", "HANDLE")}
    subprocess.run([RAY, "start", "--head", "--num-cpus=2", "--disable-usage-stats",
                    f"--metrics-export-port={METRICS_PORT}"], env={**ENV, **fast}, check=True, capture_output=True)
    import ray

    os.environ["RAY_ADDRESS"] = "auto"
    ray.init(address="auto")
    yield "http://127.0.0.1:8265"
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(store: str, root: Path) -> tuple[subprocess.Popen, str]:
    """`mlflow server` over `store`, its artifacts proxied (as the local cluster runs it) -> (process, URI)."""
    port = free_port()
    env = {**ENV, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                             "1", "--backend-store-uri", store, "--artifacts-destination", str(root / "artifacts")],
                            env=env, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2):
                return proc, uri
        except OSError:
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("mlflow server did not start: " + (root / "server.log").read_text()[-3000:])


def postgres_store(root: Path) -> tuple[str, callable]:
    """A throw-away PostgreSQL cluster (Debian's `postgresql` package; run as the `postgres` user when root) ->
    (its SQLAlchemy URI, stop)."""
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    if not bins:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg2", reason="pip install -e '.[postgres]' (psycopg2-binary)")
    # (as root: a folder the postgres user can reach; pytest's own temporary folders are private to root)
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="flexdraft-pg-")) / "data"
    pg, port = bins[-1], free_port()
    if as_user:
        shutil.chown(data.parent, "postgres")
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True)
    run(str(pg / "initdb"), "-D", str(data), "-U", "mlflow", "--auth=trust")
    run(str(pg / "pg_ctl"), "-D", str(data), "-l", str(data / "log"), "-w", "-o",
        f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start")
    run(str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow")

    def stop():
        subprocess.run([*as_user, str(pg / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data.parent, ignore_errors=True)

    return f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow", stop
