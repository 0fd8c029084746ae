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
    check_exposure(from_dict(ServeConfig, user), args.host, {**os.environ, **env_vars})  # fail closed, before Ray
    cfg.setdefault("http_options", {}).update(host=args.host, port=args.port)
    path = data_dir() / "serve" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve_bin is None:
        raise FlexDraftError("the `serve` command of Ray Serve is not installed (pip install 'ray[serve]')")
    print(f"[serve] OpenAI-compatible API at http://{args.host}:{args.port}/v1 once the replica is up "
          f"(config {path}); Ctrl-C stops it", file=sys.stderr, flush=True)
    os.execv(serve_bin, [serve_bin, "run", str(path)])


def register(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible Ray Serve app (serve run serve/config.yaml)")
    s.add_argument("--config", default=SERVE_CONFIG, help="Serve config file (default: the packaged one)")
    s.add_argument("--model", help="override user_config.model")
    s.add_argument("--drafter", help="override user_config.drafter (a folder, models:/NAME@ALIAS, 'init', '' = the default "
                                     "pipeline's)")
    s.add_argument("--store", help="override user_config.store")
    s.add_argument("--mode", help="override user_config.engine.mode")
    s.add_argument("--num-cpus", type=float, help="override each replica's ray_actor_options.num_cpus (its threads)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key "
                   "($FLEXDRAFT_API_KEY); refused otherwise")
    s.set_defaults(func=cmd_serve)
