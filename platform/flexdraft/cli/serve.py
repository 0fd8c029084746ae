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
          f"(config {path}); Ctrl-C stops it", file=sys.stderr, flush=True)
    # where `serve run` starts Ray here, its replica runs at normal CPU priority: Ray starts workers at nice 15, so any
    # other busy process on the machine (a co-located server, a load generator) took the replica's cores first
    # (beside vLLM's server on 2 cores: 0.86x its tok/s at concurrency 16 at nice 15, 1.46x at 0). A Ray already
    # running keeps its own setting; RAY_worker_niceness set by the caller wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.execv(serve_bin, [serve_bin, "run", str(path)])


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
    s.add_argument("--num-cpus", type=float, help="override each replica's ray_actor_options.num_cpus (its threads)")
    s.add_argument("--deploy", action="store_true", help="`serve deploy` to the running cluster (RAY_DASHBOARD_ADDRESS) "
                                                         "and return, instead of `serve run` here")
    s.add_argument("--host", help="bind address (default: the config's http_options.host, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port, else 8000)")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key "
                   "($FLEXDRAFT_API_KEY); refused otherwise")
    s.set_defaults(func=cmd_serve)
