"""A multi-node Ray cluster and an MLflow tracking server on one machine: `flexdraft cluster up|down|status|env`.

Each Ray node is its own `ray start --block` process in a session of its own, with its own temp dir, CPUs, GPUs
and ports, joined to the head by `--address`; the MLflow server is `mlflow server` in another session. A pid file
per process (pid + kernel start time, so a reused pid is never mistaken for ours) names what `up` started: `down`
ends those sessions and nothing else, never a process found by name, so another Ray instance on the machine is
left alone. `up` is idempotent: what runs is reported and kept, what is missing is started.

Every node starts with the cluster's client environment (MLFLOW_TRACKING_URI of the server, FLEXDRAFT_HOME,
RAY_AUTH_MODE), so jobs, trials and Serve replicas on any node log to the server and share one data dir.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flexdraft.core.config import data_dir, from_dict, read_yaml
from flexdraft.core.errors import FlexDraftError

DEFAULT_CONFIG = "infra/local/cluster.yaml"  # (the packaged copy from anywhere: `config.config_path`)
BIN = Path(sys.executable).parent  # ray, mlflow and python of this environment


@dataclass
class NodeConfig:
    name: str = "head"
    num_cpus: int = 1
    num_gpus: int = 0
    cuda_visible_devices: str = ""  # this node's GPUs, e.g. "1"; "" = inherit
    object_store_gb: float = 1.0  # shared memory for the node's object store (Ray's default takes 30% of RAM)
    resources: dict = field(default_factory=dict)  # custom resources, e.g. {"drafter_trainer": 1}


@dataclass
class RayClusterConfig:
    port: int = 6380  # the head's GCS: RAY_ADDRESS for ray.init, `ray job submit`, `serve run`
    dashboard_port: int = 8265  # RAY_DASHBOARD_ADDRESS (`serve deploy`, the dashboard)
    client_server_port: int = 10001
    agent_port: int = 52365  # node i: the dashboard agent's http port agent_port + 2i, its grpc port + 2i + 1
    worker_ports: int = 11000  # node i: worker processes bind worker_ports + 1000 i ... + 999
    auth: str = "disabled"  # disabled | token (a token file in the state dir; every node and client needs it)
    nodes: list[NodeConfig] = field(default_factory=lambda: [NodeConfig("head"), NodeConfig("worker1")])


@dataclass
class MlflowServerConfig:
    enabled: bool = True
    port: int = 5000
    backend_store_uri: str = ""  # "" = sqlite:///<state_dir>/mlflow/mlflow.db; any MLflow store URI (postgresql://...)
    artifacts_destination: str = ""  # "" = <state_dir>/mlflow/artifacts; clients reach it through the server
    workers: int = 1
    app_name: str = ""  # "basic-auth": MLflow's users and permissions (a shared server; docs/scaling.md)


@dataclass
class ClusterConfig:
    state_dir: str = ""  # pid files, logs, node temp dirs, the default MLflow store: "" = $FLEXDRAFT_HOME/cluster
    host: str = "127.0.0.1"  # the dashboard, the MLflow server and the addresses given to clients bind here
    ray: RayClusterConfig = field(default_factory=RayClusterConfig)
    mlflow: MlflowServerConfig = field(default_factory=MlflowServerConfig)

    def state(self) -> Path:
        return Path(self.state_dir).expanduser() if self.state_dir else data_dir() / "cluster"


def load_cluster_config(path: str | Path = DEFAULT_CONFIG) -> ClusterConfig:
    raw = read_yaml(path, "cluster config") or {}
    nodes = (raw.get("ray") or {}).pop("nodes", None) if isinstance(raw.get("ray"), dict) else None
    cfg = from_dict(ClusterConfig, raw)
    if nodes is not None:
        if not isinstance(nodes, list) or not nodes:
            raise FlexDraftError("cluster config ray.nodes: a list of at least one node (the first is the head)")
        cfg.ray.nodes = [from_dict(NodeConfig, n, f".ray.nodes[{i}]") for i, n in enumerate(nodes)]
    check(cfg)
    return cfg


def check(cfg: ClusterConfig) -> None:
    names = [n.name for n in cfg.ray.nodes]
    for n in cfg.ray.nodes:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", n.name):
            raise FlexDraftError(f"cluster config: node name {n.name!r}: lower-case letters, digits and '-'")
        if n.num_cpus < 0 or n.num_gpus < 0 or n.object_store_gb <= 0:
            raise FlexDraftError(f"cluster config: node {n.name}: num_cpus, num_gpus >= 0 and object_store_gb > 0")
    if len(set(names)) != len(names):
        raise FlexDraftError(f"cluster config: node names must differ, got {names}")
    if cfg.ray.auth not in ("disabled", "token"):
        raise FlexDraftError(f"cluster config ray.auth: disabled or token, got {cfg.ray.auth!r}")
    ports = [p for _, _, p in _ports(cfg)]
    if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
        raise FlexDraftError(f"cluster config: ports must be distinct and in 1-65535, got {sorted(ports)}")


def _ports(cfg: ClusterConfig) -> list[tuple[str, str, int]]:
    """(owner, what, port) of every fixed port `up` binds; the owner is the process that binds it."""
    r, head = cfg.ray, cfg.ray.nodes[0].name
    ports = [(head, "Ray GCS", r.port), (head, "Ray dashboard", r.dashboard_port),
             (head, "Ray client server", r.client_server_port)]
    for i, n in enumerate(r.nodes):
        ports += [(n.name, "dashboard agent", r.agent_port + 2 * i), (n.name, "agent grpc", r.agent_port + 2 * i + 1)]
    if cfg.mlflow.enabled:
        ports.append(("mlflow", "MLflow server", cfg.mlflow.port))
    return ports


# ------------------------------------------------------------------------------------------ processes

def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, None when no such process or a zombie (it has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # (the name may hold spaces)
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when it is not running."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22


def _session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (the session a pid file's process leads)."""
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and (fields := _stat(int(d.name))) and int(fields[3]) == sid]  # field 6: session


@dataclass
class Proc:
    """A process `up` started, as its pid file records it."""
    name: str
    pid: int
    start_time: int
    address: str
    log: str

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start_time


class State:
    """The state dir: pids/<name>.json, logs/<name>.log, mlflow/ (the default store)."""

    def __init__(self, cfg: ClusterConfig):
        self.root = cfg.state()
        for sub in ("pids", "logs", "mlflow"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def read(self, name: str) -> Proc | None:
        path = self.root / "pids" / f"{name}.json"
        if not path.is_file():
            return None
        proc = Proc(**json.loads(path.read_text()))
        if not proc.alive():  # ended without `down` (killed, crashed, machine rebooted)
            path.unlink()
            return None
        return proc

    def write(self, proc: Proc) -> None:
        (self.root / "pids" / f"{proc.name}.json").write_text(json.dumps(proc.__dict__))

    def forget(self, name: str) -> None:
        (self.root / "pids" / f"{name}.json").unlink(missing_ok=True)

    def temp_dir(self, name: str) -> Path:
        """A node's Ray temp dir: short, under /tmp, one per state dir (Ray's socket paths in it must stay within
        the 107 bytes of an AF_UNIX address)."""
        return Path(tempfile.gettempdir()) / f"flexdraft-{hashlib.sha1(str(self.root).encode()).hexdigest()[:8]}" / name

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def token(self) -> Path:
        return self.root / "auth_token"


def _spawn(state: State, name: str, cmd: list[str], env: dict, address: str) -> Proc:
    log = state.log(name)
    with open(log, "ab") as out:
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, cwd=state.root)
    proc = Proc(name, p.pid, _start_time(p.pid) or 0, address, str(log))
    state.write(proc)
    return proc


def end_session(leader: int, sig: int | None = signal.SIGTERM, grace_s: float = 45.0) -> None:
    """Send `sig` to the leader of a session we started (`ray start --block` drains its node and ends its processes,
    `serve run` shuts its apps and Ray down on SIGINT), then SIGKILL what is left of the session after `grace_s`.
    sig None: SIGKILL the whole session at once, as a machine failure would."""
    if sig is not None and _start_time(leader):
        os.kill(leader, sig)
        deadline = time.time() + grace_s
        while time.time() < deadline and _session_pids(leader):
            time.sleep(0.5)
    for pid in _session_pids(leader):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end(state: State, proc: Proc, force: bool) -> None:
    end_session(proc.pid, None if force else signal.SIGTERM)
    state.forget(proc.name)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _get_json(url: str, token: Path | None = None, timeout: float = 5.0):
    """GET url -> its JSON; with `token` (a token file), as Ray's token authentication asks."""
    headers = {"Authorization": f"Bearer {token.read_text().strip()}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------------------------------ addresses

def mlflow_uri(cfg: ClusterConfig) -> str:
    return f"http://{cfg.host}:{cfg.mlflow.port}"


def client_env(cfg: ClusterConfig) -> dict[str, str]:
    """What a client of the cluster exports (`eval "$(flexdraft cluster env)"`): Ray's and MLflow's own variables."""
    env = {"RAY_ADDRESS": f"{cfg.host}:{cfg.ray.port}",
           "RAY_DASHBOARD_ADDRESS": f"http://{cfg.host}:{cfg.ray.dashboard_port}",
           "RAY_AUTH_MODE": cfg.ray.auth}
    if cfg.ray.auth == "token":
        env["RAY_AUTH_TOKEN_PATH"] = str(State(cfg).token())
    if cfg.mlflow.enabled:
        env["MLFLOW_TRACKING_URI"] = mlflow_uri(cfg)
    return env


def _node_env(cfg: ClusterConfig, node: NodeConfig) -> dict[str, str]:
    env = {**os.environ, **client_env(cfg), "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "FLEXDRAFT_HOME": str(data_dir()),
           # a job's `python` and `flexdraft` are this environment's, whatever PATH the caller had
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS")  # a node is given its head by --address
    if node.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = node.cuda_visible_devices
    return env


def ray_nodes(cfg: ClusterConfig) -> list[dict]:
    """The cluster's nodes as its dashboard lists them (node_name, node_id, state, resources_total), [] when the
    dashboard does not answer."""
    url = f"http://{cfg.host}:{cfg.ray.dashboard_port}/api/v0/nodes?limit=1000&detail=1"
    try:
        return _get_json(url, State(cfg).token() if cfg.ray.auth == "token" else None)["data"]["result"]["result"]
    except (OSError, ValueError, KeyError):
        return []


# ------------------------------------------------------------------------------------------ up / down

def _start_mlflow(cfg: ClusterConfig, state: State) -> Proc:
    m = cfg.mlflow
    store = m.backend_store_uri or f"sqlite:///{state.root / 'mlflow' / 'mlflow.db'}"
    artifacts = m.artifacts_destination or str(state.root / "mlflow" / "artifacts")
    cmd = [str(BIN / "mlflow"), "server", "--host", cfg.host, "--port", str(m.port), "--workers", str(m.workers),
           "--backend-store-uri", store, "--artifacts-destination", artifacts, "--serve-artifacts"]
    if m.app_name:
        cmd += ["--app-name", m.app_name]
    # no job consumers: MLflow 3's server otherwise forks several for GenAI features FlexDraft does not use
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = _spawn(state, "mlflow", cmd, env, mlflow_uri(cfg))
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{proc.address}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except (OSError, urllib.error.URLError):
            pass
        if not proc.alive():
            break
        time.sleep(1)
    _end(state, proc, force=True)
    raise FlexDraftError(f"the MLflow server did not come up at {proc.address} (store {store}); "
                         f"its log {state.log('mlflow')} ends:\n{_tail(state.log('mlflow'))}")


NODE_START_ATTEMPTS = 3


def _start_node(cfg: ClusterConfig, state: State, i: int) -> Proc:
    r, node = cfg.ray, cfg.ray.nodes[i]
    cmd = [str(BIN / "ray"), "start", "--block", "--node-name", node.name, "--num-cpus", str(node.num_cpus),
           "--num-gpus", str(node.num_gpus), "--object-store-memory", str(int(node.object_store_gb * 2 ** 30)),
           "--temp-dir", str(state.temp_dir(node.name)), "--node-ip-address", cfg.host,
           "--dashboard-agent-listen-port", str(r.agent_port + 2 * i),
           "--dashboard-agent-grpc-port", str(r.agent_port + 2 * i + 1),
           "--min-worker-port", str(r.worker_ports + 1000 * i), "--max-worker-port", str(r.worker_ports + 1000 * i + 999),
           "--disable-usage-stats"]
    if node.resources:
        cmd += ["--resources", json.dumps(node.resources)]
    if i == 0:
        cmd += ["--head", "--port", str(r.port), "--dashboard-host", cfg.host, "--dashboard-port", str(r.dashboard_port),
                "--ray-client-server-port", str(r.client_server_port)]
    else:
        cmd += ["--address", f"{cfg.host}:{r.port}"]
    # `ray start` gives up when its raylet has not registered within 30 s (fixed in Ray), which a busy 2-core machine
    # can exceed: a node whose `ray start` exited that way is started again (its session's leftovers ended first)
    log = state.log(node.name)
    for _ in range(NODE_START_ATTEMPTS):
        start = log.stat().st_size if log.exists() else 0  # this attempt's output begins here (the log appends)
        proc = _spawn(state, node.name, cmd, _node_env(cfg, node), f"{cfg.host}:{r.port}")
        deadline = time.time() + 180
        while time.time() < deadline and proc.alive():
            if any(n.get("node_name") == node.name and n.get("state") == "ALIVE" for n in ray_nodes(cfg)):
                return proc
            time.sleep(1)
        _end(state, proc, force=True)
        with open(log, "rb") as f:
            f.seek(start)
            if b"timed out during startup" not in f.read():
                break
    raise FlexDraftError(f"Ray node {node.name} did not join the cluster; its log {log} ends:\n{_tail(log)}")


def up(cfg: ClusterConfig, say=print) -> dict[str, Proc]:
    """Start what is not running: the MLflow server, the head, the workers (in that order: nodes get the server's
    URI). -> every process of the cluster by name."""
    state = State(cfg)
    running = {name: p for name in ["mlflow", *(n.name for n in cfg.ray.nodes)] if (p := state.read(name))}
    if cfg.ray.nodes[0].name not in running and any(n.name in running for n in cfg.ray.nodes[1:]):
        raise FlexDraftError("the head is down but workers of it still run: `flexdraft cluster down` first")
    for name, p in running.items():
        say(f"[cluster] {name}: already running (pid {p.pid}, {p.address})")
    for owner, what, port in _ports(cfg):
        if owner not in running and _port_taken(cfg.host, port):
            raise FlexDraftError(f"port {port} ({owner}: {what}) on {cfg.host} is taken by another process: stop it, "
                                 f"or give another port in the cluster config")
    if cfg.ray.auth == "token" and not state.token().is_file():
        state.token().write_text(secrets.token_hex(32))
        state.token().chmod(0o600)
    if cfg.mlflow.enabled and "mlflow" not in running:
        t0 = time.time()
        running["mlflow"] = _start_mlflow(cfg, state)
        say(f"[cluster] mlflow: tracking server at {running['mlflow'].address} ({time.time() - t0:.0f} s)")
    for i, node in enumerate(cfg.ray.nodes):
        if node.name not in running:
            t0 = time.time()
            running[node.name] = _start_node(cfg, state, i)
            say(f"[cluster] {node.name}: {'head' if i == 0 else 'worker'} node up, {node.num_cpus} CPU "
                f"{node.num_gpus} GPU ({time.time() - t0:.0f} s)")
    return running


def down(cfg: ClusterConfig, nodes: list[str] | None = None, force: bool = False, say=print) -> list[str]:
    """End what `up` started (workers, then the head, then the MLflow server), or only the named ones; force: SIGKILL
    (a node failure). -> the names ended."""
    state = State(cfg)
    order = [n.name for n in reversed(cfg.ray.nodes)] + ["mlflow"]
    unknown = sorted(set(nodes or []) - set(order))
    if unknown:
        raise FlexDraftError(f"no such cluster process: {', '.join(unknown)} (known: {', '.join(order)})")
    ended = []
    for name in order:
        if nodes and name not in nodes:
            continue
        proc = state.read(name)
        if proc is None:
            continue
        _end(state, proc, force)
        ended.append(name)
        say(f"[cluster] {name}: {'killed' if force else 'stopped'} (pid {proc.pid})")
    if not ended:
        say("[cluster] nothing of this cluster is running")
    return ended


def status(cfg: ClusterConfig) -> dict:
    """-> {"processes": {name: pid file record or None}, "nodes": the dashboard's node list, "env": client_env}."""
    state = State(cfg)
    names = [n.name for n in cfg.ray.nodes] + (["mlflow"] if cfg.mlflow.enabled else [])
    procs = {name: state.read(name) for name in names}
    return {"processes": {k: (v.__dict__ if v else None) for k, v in procs.items()},
            "nodes": ray_nodes(cfg) if procs[cfg.ray.nodes[0].name] else [], "env": client_env(cfg)}


def format_status(st: dict) -> str:
    lines = []
    for name, p in st["processes"].items():
        lines.append(f"{name:10s} " + (f"running  pid {p['pid']:<8d} {p['address']}" if p else "stopped"))
    for n in st["nodes"]:
        res = n.get("resources_total", {})
        lines.append(f"  ray node {n.get('node_name', '?'):10s} {n.get('state', '?'):6s} {n.get('node_id', '')[:12]}  "
                     f"CPU {res.get('CPU', 0):g} GPU {res.get('GPU', 0):g}")
    lines.append("client environment (eval \"$(flexdraft cluster env)\"):")
    lines += [f"  {k}={v}" for k, v in st["env"].items()]
    return "\n".join(lines)
