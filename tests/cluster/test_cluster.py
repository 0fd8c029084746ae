"""`flexdraft cluster`: a two-node Ray cluster and an MLflow server on this machine, and what runs on it.

The lifecycle test runs in the suite. The workload tests (a training job across both nodes surviving a node
failure, a sweep's trials, Serve replicas on both nodes) take minutes of Ray start-ups on 2 cores: they run with
`pytest -m cluster tests/cluster/test_cluster.py` (docs/scaling.md shows their output).
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ENV, RAY, REPO, recorded_pipeline
from flexdraft.cluster import local as cluster
from flexdraft.core.config import from_dict
from flexdraft.drafter.recipe import PipelineConfig

FLEXDRAFT = str(Path(sys.executable).parent / "flexdraft")
SERVE = str(Path(sys.executable).parent / "serve")
# ports apart from Ray's defaults and the suite's own `ray start --head` (6379, 8265), and from infra/local's
PORTS = {"port": 6391, "dashboard_port": 8275, "client_server_port": 10091, "agent_port": 52465, "worker_ports": 13000}
MLFLOW_PORT = 5055


def _config(tmp: Path) -> Path:
    cfg = yaml.safe_load((REPO / "infra" / "local" / "cluster.yaml").read_text())
    cfg["state_dir"] = str(tmp / "state")
    cfg["ray"].update(PORTS)
    cfg["mlflow"]["port"] = MLFLOW_PORT
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "cluster.yaml"


def _cli(*args, path: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([FLEXDRAFT, "cluster", *args, "--config", str(path)], env=ENV, capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """The repository's infra/local/cluster.yaml on other ports, brought up for the module -> (config file, config)."""
    path = _config(tmp_path_factory.mktemp("cluster"))
    cfg = cluster.load_cluster_config(path)
    yield path, cfg
    cluster.down(cfg, say=lambda m: None)


def _alive_nodes(cfg) -> dict[str, str]:
    return {n["node_name"]: n["node_id"] for n in cluster.ray_nodes(cfg) if n["state"] == "ALIVE"}


def test_up_is_idempotent_and_down_ends_only_what_up_started(local_cluster, tmp_path):
    """`up`: head and worker1 join as two Ray nodes of 1 CPU each, the MLflow server answers; `up` again starts
    nothing; a node killed with SIGKILL is started again by `up`, alone; a port taken by a stranger is named;
    `down` ends every process of its sessions and leaves a stranger named `raylet` running."""
    import urllib.request

    path, cfg = local_cluster
    _cli("up", path=path)
    st = cluster.status(cfg)
    assert {n["node_name"]: n["resources_total"]["CPU"] for n in st["nodes"] if n["state"] == "ALIVE"} == \
           {"head": 1.0, "worker1": 1.0}
    assert urllib.request.urlopen(f"http://127.0.0.1:{MLFLOW_PORT}/health", timeout=10).status == 200
    pids = {k: v["pid"] for k, v in st["processes"].items()}

    again = _cli("up", path=path)
    assert again.stderr.count("already running") == 3
    assert {k: v["pid"] for k, v in cluster.status(cfg)["processes"].items()} == pids

    stranger = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 600"])  # a process of the same name, not ours
    try:
        _cli("down", "--node", "worker1", "--force", path=path)
        deadline = time.time() + 60
        while "worker1" in _alive_nodes(cfg) and time.time() < deadline:
            time.sleep(1)
        assert set(_alive_nodes(cfg)) == {"head"}
        restarted = _cli("up", path=path)
        assert restarted.stderr.count("already running") == 2 and "worker1: worker node up" in restarted.stderr
        assert set(_alive_nodes(cfg)) == {"head", "worker1"}

        other = yaml.safe_load(path.read_text())
        other["state_dir"] = str(tmp_path / "other")  # another cluster on the same ports: refused, by port
        (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
        refused = _cli("up", path=tmp_path / "other.yaml", check=False)
        assert refused.returncode == 2
        assert f"port {PORTS['port']} (head: Ray GCS) on 127.0.0.1 is taken" in refused.stderr

        sessions = [v["pid"] for v in cluster.status(cfg)["processes"].values()]
        _cli("down", path=path)
        assert not any(cluster._session_pids(s) for s in sessions)
        assert all(v is None for v in cluster.status(cfg)["processes"].values())
        assert stranger.poll() is None
    finally:
        stranger.kill()


def test_bad_cluster_config_is_one_line(tmp_path):
    """Duplicate node names, an unknown auth mode and a port used twice are refused before anything starts."""
    base = yaml.safe_load((REPO / "infra" / "local" / "cluster.yaml").read_text())
    for change, msg in [({"nodes": [{"name": "a"}, {"name": "a"}]}, "node names must differ"),
                        ({"auth": "password"}, "ray.auth: disabled or token"),
                        ({"dashboard_port": base["ray"]["port"]}, "ports must be distinct")]:
        cfg = json.loads(json.dumps(base))
        cfg["ray"].update(change)
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        proc = _cli("status", path=tmp_path / "c.yaml", check=False)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr


def test_a_node_whose_ray_start_timed_out_is_started_again(tmp_path, monkeypatch):
    """`ray start` gives up after 30 s without its raylet registered (a busy machine): the node is started again, its
    first session ended; a node that fails otherwise is not retried and the error names its log."""
    cfg = cluster.load_cluster_config(_config(tmp_path))
    state = cluster.State(cfg)
    spawned, spawn = [], cluster._spawn

    def fake_spawn(state, name, cmd, env, address, outcomes):
        spawned.append(name)
        script = outcomes[len(spawned) - 1]
        return spawn(state, name, ["sh", "-c", script], env, address)

    def run(outcomes):
        spawned.clear()
        monkeypatch.setattr(cluster, "_spawn", lambda *a: fake_spawn(*a, outcomes=outcomes))
        monkeypatch.setattr(cluster, "ray_nodes", lambda cfg: [{"node_name": cfg.ray.nodes[0].name, "state": "ALIVE"}]
                            if len(spawned) == 2 else [])
        return cluster._start_node(cfg, state, 0)

    timeout = "echo 'Exception: The current node timed out during startup.'; exit 1"
    proc = run([timeout, "sleep 60"])  # the second start joins
    assert len(spawned) == 2 and proc.alive()
    cluster._end(state, proc, force=True)
    with pytest.raises(cluster.FlexDraftError, match="(?s)did not join the cluster.*port is taken"):
        run(["echo 'port is taken'; exit 1", "sleep 60"])
    assert len(spawned) == 1


# ------------------------------------------------------------------------------ workloads on the cluster

def _submit(cfg, entrypoint: list[str], tmp_path: Path, wait: bool = True) -> str:
    env = {**ENV, **cluster.client_env(cfg)}
    proc = subprocess.run([RAY, "job", "submit", "--working-dir", str(REPO), *([] if wait else ["--no-wait"]),
                           "--", *entrypoint], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc.stdout


def _job_id(stdout: str) -> str:
    return next(w.strip("'") for line in stdout.splitlines() for w in line.split() if w.strip("'").startswith("raysubmit_"))


@pytest.mark.cluster
def test_training_job_spans_both_nodes_logs_to_the_server_and_resumes_after_a_node_fails(local_cluster, tiny_pipeline,
                                                                                         tmp_path):
    """`ray job submit` of the attention stage: its 2 Ray Train workers run one on each node and rank 0 logs to the
    MLflow server over HTTP. worker1 is killed (SIGKILL of its whole session) mid-training: the job waits (Ray
    Train's FailureConfig retries) until `up` brings the node back, resumes from its last checkpoint on both nodes
    again, and ends with every tensor of the drafter of an uninterrupted run: no step lost or repeated."""
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    from flexdraft.drafter.model import load_drafter
    from flexdraft.models.loading import load_model

    path, cfg = local_cluster
    _cli("up", path=path)
    nodes = _alive_nodes(cfg)
    _, raw, _ = tiny_pipeline
    attention = {**raw["attention"], "steps": 200, "checkpoint_every": 20, "log_every": 10}
    outs = {}
    for name in ("reference", "failover"):
        job = dict(raw, name=f"tiny-{name}", output_dir=str(tmp_path / name), attention=attention)
        dst = from_dict(PipelineConfig, job).distill_dir()  # the tiny data, shared
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(from_dict(PipelineConfig, raw).distill_dir())
        (tmp_path / f"{name}.yaml").write_text(json.dumps(job))
        outs[name] = tmp_path / name
    out = _submit(cfg, ["python", "jobs/attn_tuning.py", "--config", str(tmp_path / "reference.yaml")], tmp_path)
    print("reference job:", *[line for line in out.splitlines() if "ranks on Ray nodes" in line or "done" in line])

    client = JobSubmissionClient(cluster.client_env(cfg)["RAY_DASHBOARD_ADDRESS"])
    job_id = _job_id(_submit(cfg, ["python", "jobs/attn_tuning.py", "--config", str(tmp_path / "failover.yaml")],
                             tmp_path, wait=False))
    deadline = time.time() + 600
    while "step 50/200" not in client.get_job_logs(job_id):  # past the checkpoint of step 40
        assert time.time() < deadline and client.get_job_status(job_id) in (JobStatus.PENDING, JobStatus.RUNNING), \
            client.get_job_logs(job_id)
        time.sleep(0.3)
    killed_after = max(int(line.split("step ")[1].split("/")[0]) for line in client.get_job_logs(job_id).splitlines()
                       if "] step " in line)
    cluster.down(cfg, ["worker1"], force=True, say=print)
    time.sleep(15)  # the failure is noticed; the job waits for 2 CPUs
    cluster.up(cfg, say=print)
    while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.time() < deadline, client.get_job_logs(job_id)[-4000:]
        time.sleep(2)
    logs = client.get_job_logs(job_id)
    print(logs[-6000:])
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED

    run_id = next(outs["failover"].glob("attention-*.mlflow-run")).read_text()
    mlflow = MlflowClient(cluster.client_env(cfg)["MLFLOW_TRACKING_URI"])
    tags = mlflow.get_run(run_id).data.tags
    attempts = {int(k.rsplit("_", 1)[1]): v.split(",") for k, v in tags.items() if k.startswith("ray_nodes.from_step_")}
    print("killed after step", killed_after, "attempts (from step: rank nodes):", attempts, "nodes:", nodes)
    assert set(attempts[0]) == set(nodes.values())  # one worker on each node
    resumed_from = max(attempts)  # the last checkpoint Ray Train had registered (both ranks' reports polled)
    assert resumed_from % 20 == 0 and 20 <= resumed_from <= killed_after
    assert set(attempts[resumed_from]) == set(_alive_nodes(cfg).values()) and len(set(attempts[resumed_from])) == 2
    history = mlflow.get_metric_history(run_id, "train/loss")
    by_step: dict[int, set] = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(round(m.value, 6))
    assert sorted(by_step) == list(range(10, 201, 10))  # every step logged, none lost
    assert all(len(v) == 1 for v in by_step.values())  # a replayed step gave the same loss as before the failure

    target = load_model(raw["model"], with_tokenizer=False).model
    ref = load_drafter(outs["reference"] / "drafter-attention", target).state_dict()
    ours = load_drafter(outs["failover"] / "drafter-attention", target).state_dict()
    assert ref.keys() == ours.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.cluster
def test_sweep_trials_run_on_both_nodes(local_cluster, tiny_smollm2, tmp_path):
    """A 2-trial decode sweep submitted as a Ray job, trials of 1 CPU, 2 at a time: one trial on each node, each
    trial's MLflow run (on the server) naming its node."""
    from mlflow.tracking import MlflowClient

    from conftest import write_jsonl

    path, cfg = local_cluster
    _cli("up", path=path)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in
                                                       ("Name three rivers.", "What is a prime number?")])
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": f"cluster-{tmp_path.name}", "output_dir": str(tmp_path / "sweep"),  # (not a user's earlier one)
        "model": str(tiny_smollm2), "drafter": "init", "store": "none",
        "threads": 1, "prompts": str(prompts), "space": {"switch_batch": [1, 4]}, "first": [{}, {"switch_batch": 1}],
        "trials": 2, "max_concurrent_trials": 2, "time_budget_min": 10,
        "objective": {"batch_sizes": [1], "weights": [1], "prompts": 2, "max_new_tokens": 8}}))
    out = _submit(cfg, ["python", "tuning/sweep.py", "--config", str(tmp_path / "sweep.yaml")], tmp_path)
    assert "2/2 trials measured" in out, out[-3000:]
    mlflow = MlflowClient(cluster.client_env(cfg)["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name("flexdraft-sweeps")
    trials = [r for r in mlflow.search_runs([exp.experiment_id]) if "trial_id" in r.data.tags]
    print("trial runs on nodes:", {r.data.tags["trial_id"]: r.data.tags["ray_node"] for r in trials})
    assert {r.data.tags["ray_node"] for r in trials} == set(_alive_nodes(cfg).values())


def _served_versions(uri: str, runs_before: set, n: int, timeout: float) -> dict[str, tuple[str, str]]:
    """{replica: (its Ray node, the drafter version it serves)} from the replicas' running serving runs in the
    cluster's MLflow server (started since `runs_before`), once `n` replicas have one."""
    from mlflow.tracking import MlflowClient

    client, deadline, seen = MlflowClient(uri), time.time() + timeout, {}
    while time.time() < deadline:
        exp = client.get_experiment_by_name("flexdraft-serve")
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
        seen = {r.data.tags["replica"]: (r.data.tags["ray_node"], r.data.tags.get("flexdraft.drafter_version", ""))
                for r in runs if r.info.run_id not in runs_before}
        if len(seen) >= n:
            break
        time.sleep(2)
    return seen


def _run_ids(uri: str) -> set:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("flexdraft-serve")
    return {r.info.run_id for r in client.search_runs([exp.experiment_id])} if exp else set()


@pytest.mark.cluster
def test_serve_replicas_on_both_nodes_load_the_champion_from_the_server_and_roll_over_on_promotion(
        local_cluster, tiny_smollm2, tiny_pipeline, tmp_path, monkeypatch):
    """serve/config.yaml's app deployed to the cluster (`flexdraft serve --deploy`) with 2 replicas of 1 CPU and
    `drafter: models:/flexdraft-drafter-tiny@champion`: one replica on each node, each downloading version 1 from
    the cluster's MLflow server (the drafters' folders are deleted once registered: no shared path) and saying so
    in its serving run (replica, Ray node, version); requests through the head's proxy are answered. After
    `flexdraft drafters promote .../2 --alias champion`, deploying again rolls both replicas over to version 2 in
    place (the same replicas, new serving runs)."""
    import shutil

    import httpx

    from flexdraft.training.register import register_drafter

    path, cfg = local_cluster
    _cli("up", path=path)
    env = {**ENV, **cluster.client_env(cfg), "FLEXDRAFT_HOME": str(tmp_path / "client-home")}
    for key in ("MLFLOW_TRACKING_URI", "FLEXDRAFT_HOME"):
        monkeypatch.setenv(key, env[key])
    data = tiny_pipeline[0].distill_dir()
    versions = [register_drafter(recorded_pipeline(tiny_smollm2, tmp_path / "train", name, data, seed))
                for name, seed in (("one", 1), ("two", 2))]
    assert versions == ["models:/flexdraft-drafter-tiny/1", "models:/flexdraft-drafter-tiny/2"]
    shutil.rmtree(tmp_path / "train")  # the registry's copies on the server are all that is left
    app_cfg = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    app_cfg["http_options"]["port"] = 8095
    app = app_cfg["applications"][0]
    app["runtime_env"]["env_vars"]["FLEXDRAFT_HOME"] = str(tmp_path / "replica-home")  # their own download cache
    d = app["deployments"][0]
    d["ray_actor_options"] = {"num_cpus": 1}
    d["autoscaling_config"].update(min_replicas=2, max_replicas=2)
    d["user_config"].update(model=str(tiny_smollm2), store="none", mlflow_every_s=5,
                            runtime={"device": "cpu", "dtype": "float32", "threads": 1})
    d["user_config"]["engine"].update(max_batch=4)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(app_cfg))
    deploy = [FLEXDRAFT, "serve", "--config", str(tmp_path / "serve.yaml"), "--deploy",
              "--drafter", "models:/flexdraft-drafter-tiny@champion"]
    subprocess.run(deploy, env=env, check=True, timeout=120)
    try:
        deadline, replicas = time.time() + 300, []
        while time.time() < deadline:
            apps = httpx.get(f"{env['RAY_DASHBOARD_ADDRESS']}/api/serve/applications/", timeout=10).json()
            dep = apps.get("applications", {}).get("flexdraft", {}).get("deployments", {}).get("FlexDraftServer", {})
            replicas = [r for r in dep.get("replicas", []) if r["state"] == "RUNNING"]
            if len(replicas) == 2:
                break
            time.sleep(2)
        nodes = {v: k for k, v in _alive_nodes(cfg).items()}
        print("replicas on nodes:", [(r["replica_id"], nodes.get(r["node_id"])) for r in replicas])
        assert {r["node_id"] for r in replicas} == set(nodes)
        before = _served_versions(env["MLFLOW_TRACKING_URI"], set(), 2, 120)
        print("before promotion, replica -> (node, drafter version):",
              {k: (nodes.get(n), v) for k, (n, v) in before.items()})
        assert {n for n, _ in before.values()} == set(nodes) and {v for _, v in before.values()} == {versions[0]}
        assert httpx.get("http://127.0.0.1:8095/health", timeout=10).json()["drafter_version"] == versions[0]
        for _ in range(4):
            r = httpx.post("http://127.0.0.1:8095/v1/completions", json={"prompt": "Once upon", "max_tokens": 8},
                           timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

        runs_before = _run_ids(env["MLFLOW_TRACKING_URI"])
        subprocess.run([FLEXDRAFT, "drafters", "promote", versions[1], "--alias", "champion"], env=env, check=True,
                       timeout=60)
        subprocess.run(deploy, env=env, check=True, timeout=120)
        after = _served_versions(env["MLFLOW_TRACKING_URI"], runs_before, 2, 240)
        print("after promotion and redeploy, replica -> (node, drafter version):",
              {k: (nodes.get(n), v) for k, (n, v) in after.items()})
        assert after.keys() == before.keys() and {v for _, v in after.values()} == {versions[1]}  # in place
        r = httpx.post("http://127.0.0.1:8095/v1/completions", json={"prompt": "Once upon", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
        assert sorted(p.name for p in (tmp_path / "replica-home" / "registry" / "flexdraft-drafter-tiny").iterdir()
                      if p.is_dir()) == ["1", "2"]
    finally:
        subprocess.run([SERVE, "shutdown", "-y"], env=env, capture_output=True, timeout=120)
