"""`flexdraft cluster up|down|status|env`: a multi-node Ray cluster and an MLflow server on this machine."""
from __future__ import annotations

import json
import sys

from flexdraft.cli.flags import add_console_flags


def cmd_cluster(args) -> None:
    """A multi-node Ray cluster and an MLflow server on this machine (infra/local/cluster.yaml)."""
    from flexdraft.cluster import local as cluster

    cfg = cluster.load_cluster_config(args.config)
    if args.action == "up":
        cluster.up(cfg, say=lambda m: print(m, file=sys.stderr, flush=True))
        print(cluster.format_status(cluster.status(cfg)))
    elif args.action == "down":
        cluster.down(cfg, args.node or None, force=args.force, say=lambda m: print(m, file=sys.stderr, flush=True))
    elif args.action == "status":
        st = cluster.status(cfg)
        print(json.dumps(st, indent=2) if args.json else cluster.format_status(st))
    else:
        print("\n".join(f"export {k}={v}" for k, v in cluster.client_env(cfg).items()))


def register(sub) -> None:
    c = sub.add_parser("cluster", help="a multi-node Ray cluster and an MLflow tracking server on this machine")
    c.add_argument("action", choices=("up", "down", "status", "env"),
                   help="up: start what is not running; down: end what up started; env: the client's exports")
    c.add_argument("--config", default="infra/local/cluster.yaml", help="cluster YAML")
    c.add_argument("--node", action="append", help="down: only this node (or mlflow); repeatable")
    c.add_argument("--force", action="store_true", help="down: SIGKILL at once, as a machine failure would")
    c.add_argument("--json", action="store_true", help="status as JSON")
    add_console_flags(c, when=lambda args: args.action == "up")  # `env` is eval'd: its stdout stays its own
    c.set_defaults(func=cmd_cluster)
