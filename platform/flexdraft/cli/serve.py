"""`flexdraft serve`: `serve run` of the packaged Serve config with the given overrides, checked first."""
from __future__ import annotations

import sys
from pathlib import Path

from flexdraft.core.errors import FlexDraftError

SERVE_CONFIG = "serve/config.yaml"

def cmd_serve(args) -> None:
    """`serve run` of serve/config.yaml with the given overrides (checked before Ray starts); runs until Ctrl-C."""
    import os
    import shutil

    import yaml

    from flexdraft.cli.flags import proposer_settings
    from flexdraft.core.config import data_dir, from_dict, read_yaml
    from flexdraft.serving.config import ServeConfig, check_exposure

    cfg = read_yaml(args.config, "Serve config")
    app = cfg["applications"][0]
    env_vars = app["runtime_env"].setdefault("env_vars", {})
    user = app["deployments"][0].setdefault("user_config", {})
    key_env = user.get("api_key_env", "FLEXDRAFT_API_KEY")
    # replicas on a cluster's nodes log, read and authenticate as this shell
    for key in ("MLFLOW_TRACKING_URI", "FLEXDRAFT_HOME", key_env):
        if key in os.environ:
            env_vars.setdefault(key, os.environ[key])
    if args.insecure:
        user["insecure"] = True
    for key in ("model", "drafter", "store"):
        if getattr(args, key) is not None:
            user[key] = getattr(args, key)
    if args.mode:
        user.setdefault("engine", {})["mode"] = args.mode
    if args.proposer:
        user.setdefault("engine", {}).setdefault("proposers", {}).update(proposer_settings(args.proposer))
    if args.num_cpus is not None:  # e.g. 1 on a cluster of 1-CPU nodes (a replica larger than every node never starts)
        app["deployments"][0].setdefault("ray_actor_options", {})["num_cpus"] = args.num_cpus
    pin_drafter(user)
    http = cfg.setdefault("http_options", {})  # the flags win over the config file, which wins over loopback:8000
    http.update(host=args.host or http.get("host") or "127.0.0.1", port=args.port or http.get("port") or 8000)
    check_exposure(from_dict(ServeConfig, user), http["host"], {**os.environ, **env_vars})  # fail closed, before Ray
    path = data_dir() / "serve" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve_bin is None:
        raise FlexDraftError("the `serve` command of Ray Serve is not installed (pip install 'ray[serve]')")
    if args.deploy:  # onto the running cluster (RAY_DASHBOARD_ADDRESS); an unchanged app is left as it is
        import subprocess

        print(f"[serve] deploying {path} to {os.environ.get('RAY_DASHBOARD_ADDRESS', 'http://localhost:8265')}",
              file=sys.stderr, flush=True)
        if subprocess.call([serve_bin, "deploy", str(path)]):
            raise FlexDraftError(f"serve deploy {path} failed (its output is above)")
        return
    print(f"[serve] OpenAI-compatible API at http://{http['host']}:{http['port']}/v1 once the replica is up "
          f"(config {path}); Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    # where `serve run` starts Ray here, its replica runs at normal CPU priority: Ray starts workers at nice 15, so any
    # other busy process on the machine (a co-located server, a load generator) took the replica's cores first
    # (beside vLLM's server on 2 cores: 0.86x its tok/s at concurrency 16 at nice 15, 1.46x at 0). A Ray already
    # running keeps its own setting; RAY_worker_niceness set by the caller wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    grace = float(app["deployments"][0].get("graceful_shutdown_timeout_s", SERVE_GRACE_S))
    supervise([serve_bin, "run", str(path)], app["name"], grace)


SERVE_GRACE_S = 20.0  # Serve's default graceful_shutdown_timeout_s: what a replica gives its in-flight requests
RAY_STOP_S = 30.0  # what `serve run` takes to stop Serve and the Ray it started


def supervise(argv: list[str], app: str, grace_s: float) -> None:
    """Run `serve run` (argv) as a child in a session of its own until it ends, or until this process gets SIGTERM
    (docker stop, Kubernetes, systemd) or SIGINT (Ctrl-C). Then the app is deleted (`drain`): Serve stops routing
    to it and each replica finishes its in-flight requests for up to grace_s (graceful_shutdown_timeout_s), while
    the proxy keeps their streams open; then `serve run` gets SIGINT and stops Serve and Ray. Past grace_s +
    RAY_STOP_S the child's session is killed (FlexDraftError). Says in one line how it stopped. (`serve run` alone
    answers SIGTERM with Ray's driver handler, exit 15 at once, and its SIGINT path stops the proxy before the
    replicas' streams end.)"""
    import os
    import signal
    import subprocess
    import time

    got: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        child = subprocess.Popen(argv, start_new_session=True)  # (Ctrl-C at the terminal reaches only this process)
        while child.poll() is None and not got:
            time.sleep(0.2)
        if not got:
            if child.returncode:
                raise FlexDraftError(f"serve run exited with {child.returncode} (its output is above)")
            return
        name, t0 = signal.Signals(got[0]).name, time.monotonic()
        print(f"[serve] {name}: draining (in-flight requests get up to {grace_s:g} s)", file=sys.stderr, flush=True)
        drained = drain(app)
        for s in handlers:  # (Ray's driver put its own handler in)
            signal.signal(s, lambda signum, frame: got.append(signum))
        child.send_signal(signal.SIGINT)
        try:
            child.wait(grace_s + RAY_STOP_S - (time.monotonic() - t0))
        except (subprocess.TimeoutExpired, ValueError):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise FlexDraftError(f"serve run did not stop within {grace_s + RAY_STOP_S:g} s of {name}: killed") \
                from None
        print(f"[serve] stopped on {name} in {time.monotonic() - t0:.1f} s: "
              f"{'in-flight requests finished' if drained is True else 'the app could not be drained: ' + drained}",
              file=sys.stderr, flush=True)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def drain(app: str) -> bool | str:
    """Delete the Serve app on the Ray this machine runs -> True once its replicas have stopped (each after its
    in-flight requests, for up to its graceful_shutdown_timeout_s), else why not."""
    try:
        import ray
        from ray import serve

        ray.init(address="auto", namespace="serve", logging_level="ERROR", log_to_driver=False)
        try:
            serve.delete(app)
        finally:
            ray.shutdown()
        return True
    except Exception as e:  # noqa: BLE001 - Ray already gone or never up: stopping `serve run` is all that is left
        return f"{type(e).__name__}: {e}"


def pin_drafter(user: dict) -> None:
    """A drafter named by a registry alias (models:/NAME@ALIAS) gets the version the alias names now as
    `drafter_version`: every replica, also one autoscaling adds later, loads that version, and deploying again
    after `flexdraft drafters promote` rolls the replicas over. A bad reference fails here, before Ray."""
    from flexdraft.drafter.registry import is_model_uri, lookup

    ref = user.get("drafter") or ""
    if is_model_uri(ref) and "@" in ref:
        v = lookup(ref)
        if user.get("drafter_version") not in (None, "", v.version):
            print(f"[serve] {ref} is version {v.version} now (the config pinned {user['drafter_version']})",
                  file=sys.stderr)
        user["drafter_version"] = v.version
        print(f"[serve] drafter {ref} = {v.uri} (pinned for every replica; after `flexdraft drafters promote`, "
              "deploy again to roll over)", file=sys.stderr, flush=True)


def register(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible Ray Serve app (serve run serve/config.yaml)")
    s.add_argument("--config", default=SERVE_CONFIG, help="Serve config file (default: the packaged one)")
    s.add_argument("--model", help="override user_config.model")
    s.add_argument("--drafter", help="override user_config.drafter (a folder, models:/NAME@ALIAS, 'init', '' = the default "
                                     "pipeline's)")
    s.add_argument("--store", help="override user_config.store")
    s.add_argument("--mode", help="override user_config.engine.mode")
    s.add_argument("--proposer", action="append", default=[], metavar="NAME[=JSON]",
                   help="add a draft source to user_config.engine.proposers (see flexdraft generate --help); the "
                        "replicas must be able to import it (installed, or on runtime_env PYTHONPATH)")
    s.add_argument("--num-cpus", type=float, help="override each replica's ray_actor_options.num_cpus (its threads)")
    s.add_argument("--deploy", action="store_true", help="`serve deploy` to the running cluster (RAY_DASHBOARD_ADDRESS) "
                                                         "and return, instead of `serve run` here")
    s.add_argument("--host", help="bind address (default: the config's http_options.host, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port, else 8000)")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key "
                   "($FLEXDRAFT_API_KEY); refused otherwise")
    s.set_defaults(func=cmd_serve)
