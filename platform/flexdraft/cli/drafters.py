"""`flexdraft drafters list | show REF | lineage REF | promote REF --alias NAME`: the registered drafters (a thin
layer over MLflow's model registry, `drafter.registry`) and `flexdraft report REF`, the page that puts one
version's validation, benchmark, sweep, serving and load-test results side by side."""
from __future__ import annotations

import json
import time


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ms / 1000)) if ms else "?"


def cmd_list(args) -> None:
    from flexdraft.drafter.registry import list_versions

    versions = list_versions(args.name)
    if args.json:
        print(json.dumps([v.__dict__ for v in versions], indent=1))
        return
    if not versions:
        print("no drafters registered yet: `flexdraft pipeline` registers the one it trains")
        return
    print(f"{'model URI':<40} {'aliases':<16} {'tau':>5} {'k':>3} {'B':>3}  {'trained':<16} pipeline")
    for v in versions:
        print(f"{v.uri:<40} {','.join(v.aliases) or '-':<16} {v.tag('tau.bonus', '-')[:5]:>5} {v.tag('k', '-'):>3} "
              f"{v.tag('block_size', '-'):>3}  {_when(v.created_ms):<16} {v.tag('pipeline', '-')}")


def cmd_show(args) -> None:
    from flexdraft.drafter.registry import TAG, lookup

    v = lookup(args.ref)
    if args.json:
        print(json.dumps(v.__dict__, indent=1))
        return
    print(f"{v.uri}" + (f"  (aliases: {', '.join('@' + a for a in v.aliases)})" if v.aliases else ""))
    if v.description:
        print(f"  {v.description}")
    print(f"  registered {_when(v.created_ms)} from LoggedModel {v.model_id or '?'} (run {v.run_id})")
    groups: dict[str, list[tuple[str, str]]] = {}
    for key, value in sorted(v.tags.items()):
        if key.startswith(TAG):
            name = key.removeprefix(TAG)
            groups.setdefault(name.split(".")[0] if "." in name else "drafter", []).append((name, value))
    for group, items in groups.items():
        print(f"  {group}:")
        for name, value in items:
            print(f"    {name:<28} {value}")


def cmd_promote(args) -> None:
    from flexdraft.drafter.registry import promote

    v, before = promote(args.ref, args.alias)
    was = f" (was version {before})" if before and before != v.version else (" (unchanged)" if before else "")
    print(f"models:/{v.name}@{args.alias} -> version {v.version}{was}; Serve apps with user_config.drafter "
          f"models:/{v.name}@{args.alias} switch when deployed again (`flexdraft serve --deploy`)")


def cmd_lineage(args) -> None:
    from flexdraft.evaluation.drafter_report import lineage_rows

    for step, what in lineage_rows(args.ref):
        print(f"{step:<16} {what}")


def cmd_report(args) -> None:
    from flexdraft.evaluation.drafter_report import write_report

    path = write_report(args.ref, args.out)
    print(f"report: {path} (also logged to MLflow)")


def register(sub) -> None:
    d = sub.add_parser("drafters", help="registered drafters (MLflow model registry): list, show, promote")
    dsub = d.add_subparsers(dest="action", required=True)
    ls = dsub.add_parser("list", help="every registered drafter version, newest first")
    ls.add_argument("--name", help="one registered model (default: every flexdraft-drafter-*)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    sh = dsub.add_parser("show", help="one version: target, shape, validation tau, lineage, policy, serving")
    sh.add_argument("ref", help="models:/NAME/VERSION, models:/NAME@ALIAS or models:/NAME/latest")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_show)
    li = dsub.add_parser("lineage", help="data -> distill, attention, calibration runs -> version -> sweep + "
                                         "policy -> serving runs -> load tests, from the MLflow API")
    li.add_argument("ref", help="models:/NAME/VERSION, models:/NAME@ALIAS or models:/NAME/latest")
    li.set_defaults(func=cmd_lineage)
    pr = dsub.add_parser("promote", help="point an alias (champion, canary, ...) at a version")
    pr.add_argument("ref", help="the version: models:/NAME/VERSION (or @ALIAS, latest)")
    pr.add_argument("--alias", default="champion", help="the alias to set (default: champion)")
    pr.set_defaults(func=cmd_promote)
    r = sub.add_parser("report", help="one drafter version's results side by side: a markdown + HTML page with "
                                      "plots, also logged to MLflow")
    r.add_argument("ref", help="models:/NAME/VERSION or models:/NAME@ALIAS")
    r.add_argument("--out", help="folder for the page (default: $FLEXDRAFT_HOME/reports/NAME-vVERSION)")
    r.set_defaults(func=cmd_report)
