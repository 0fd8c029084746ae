"""`flexdraft report REF`: one registered drafter version's story on one page, from the MLflow API only: its
lineage (data -> distill, attention, calibration runs -> version -> sweep + policy -> serving -> load tests), its
validation tau, benchmark speed-ups by batch size, the attached sweep's results, production acceptance over time
and load-test speed-ups by concurrency. Written as Markdown and HTML with PNG plots, and logged as a run of the
`flexdraft-reports` experiment (the version gets a `flexdraft.report.last_run` tag).

Runs are found by the drafter's weights digest (`flexdraft.drafter_digest` tag): a bench run over the same
weights from a folder counts as much as one through the registry."""
from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexdraft.core.config import data_dir
from flexdraft.drafter.registry import Version, client, lookup, set_tags
from flexdraft.evaluation.report import save_figure

EXPERIMENTS = {"bench": "flexdraft-bench", "serve": "flexdraft-serve", "loadtest": "flexdraft-loadtest"}


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)


def measured_with(c, v: Version) -> dict[str, list]:
    """{"bench" | "serve" | "loadtest": the runs of that experiment over this version's weights, oldest first}."""
    digest = v.tag("weights_digest")
    return {k: _runs(c, name, digest) if digest else [] for k, name in EXPERIMENTS.items()}


def _runs(c, experiment: str, digest: str) -> list:
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return c.search_runs([exp.experiment_id], f"tags.`flexdraft.drafter_digest` = '{digest}'",
                         order_by=["attributes.start_time ASC"], max_results=200)


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ms / 1000)) if ms else "?"


def _run_cell(c, run_id: str) -> str:
    if not run_id:
        return "-"
    try:
        r = c.get_run(run_id)
    except Exception:  # noqa: BLE001 - a deleted run is shown as such, not an error
        return f"{run_id[:8]} (not found)"
    return f"{r.info.run_name} ({run_id[:8]}, {r.info.status.lower()}, {_when(r.info.start_time)})"


def lineage(c, v: Version, serving: list, loadtests: list) -> Section:
    """dataset -> distill run -> attention run -> calibration run -> model version -> sweep + policy -> serving
    runs -> load-test runs, each with its run name, id, status and start."""
    rows = [["dataset", f"{v.tag('dataset.name')} (digest {v.tag('dataset.digest')}, "
                        f"{v.tag('dataset.sequences')} sequences, {v.tag('dataset.source')})"],
            ["distill run", _run_cell(c, v.tag("run.distill"))],
            ["attention run", _run_cell(c, v.tag("run.attention"))],
            ["calibration run", _run_cell(c, v.tag("run.calibration"))],
            ["model version", f"{v.uri}" + (f" (@{', @'.join(v.aliases)})" if v.aliases else "")
                              + f", LoggedModel {v.model_id}"],
            ["sweep + policy", (f"{v.tag('policy.sweep')}: " + _run_cell(c, v.tag("policy.run_id"))
                                + f", {v.tag('policy.uri')}") if v.tag("policy.uri") else "-"]]
    rows += [["serving run", f"{r.info.run_name} ({r.info.run_id[:8]}, {r.info.status.lower()}, "
                             f"app {r.data.tags.get('app', '?')}, {_when(r.info.start_time)})"] for r in serving]
    rows += [["load-test run", f"{r.info.run_name} ({r.info.run_id[:8]}, "
                               f"{r.data.tags.get('flexdraft.app', '?')}/{r.data.tags.get('flexdraft.deployment', '?')}, "
                               f"{_when(r.info.start_time)})"] for r in loadtests]
    return Section("Lineage", tables=[(["step", "what"], rows)])


def lineage_rows(ref: str) -> list[list[str]]:
    """The lineage of a registered version as (step, what) rows (`flexdraft drafters lineage`)."""
    c = client()
    v = lookup(ref, c)
    found = measured_with(c, v)
    return lineage(c, v, found["serve"], found["loadtest"]).tables[0][1]


def validation(v: Version) -> Section:
    names = {"bonus": "bonus known (sequential, parallel)", "mask": "masked slot 0", "mask_calibrated":
             "masked + calibrated", "tree8": "8-node token tree", "tree16": "16-node token tree"}
    rows = [[label, v.tag(f"tau.{key}")] for key, label in names.items() if v.tag(f"tau.{key}")]
    return Section("Validation", [f"Accepted tokens per block (tau) on the held-out distilled prompts; target "
                                  f"{v.tag('base_model')} (fingerprint {v.tag('base_fingerprint')}), k={v.tag('k')}, "
                                  f"B={v.tag('block_size')}, {v.tag('trained_steps')} calibration steps, "
                                  f"trained on {v.tag('hw.cpu')}, commit {v.tag('git_commit')[:12]}."],
                   [(["drafts", "tau"], rows)])


def benchmark(runs: list, out: Path) -> Section:
    s = Section("Benchmark (flexdraft bench)")
    if not runs:
        s.text.append("No benchmark run over these weights yet: `flexdraft bench --drafter REF`.")
        return s
    r = runs[-1]
    speedups: dict[str, dict[int, float]] = {}
    for key, value in r.data.metrics.items():
        m = re.fullmatch(r"mean_speedup_ar\.(.+)\.b(\d+)", key)
        if m:
            speedups.setdefault(m[1], {})[int(m[2])] = value
    batches = sorted({b for per in speedups.values() for b in per})
    s.text.append(f"Latest of {len(runs)} run(s): {r.info.run_name} ({r.info.run_id[:8]}, {_when(r.info.start_time)}); "
                  "speed-up over AR, mean over the datasets.")
    s.tables.append((["method"] + [f"batch {b}" for b in batches],
                     [[m] + [f"{per[b]:.2f}x" if b in per else "-" for b in batches] for m, per in sorted(speedups.items())]))
    s.images.append(_plot(out / "bench.png", "speed-up over AR by batch size", "batch size", "x AR",
                          {m: sorted(per.items()) for m, per in speedups.items()}, log_x=True))
    return s


def sweep(c, v: Version) -> Section:
    s = Section("Sweep and policy")
    run_id = v.tag("policy.run_id")
    if not run_id:
        s.text.append(f"No policy attached: `flexdraft sweep --config tuning/configs/decode.yaml --drafter {v.uri}`.")
        return s
    m = c.get_run(run_id).data.metrics
    rows = [[k.removeprefix("best/").removesuffix("/speedup").replace("b", "batch ", 1), f"{val:.2f}x"]
            for k, val in sorted(m.items()) if re.fullmatch(r"best/b\d+/speedup", k)]
    s.text.append(f"Sweep {v.tag('policy.sweep')} (run {run_id[:8]}), objective {v.tag('policy.objective')}; its "
                  f"policy: `--policy {v.uri}`.")
    s.tables.append((["batch", "best speed-up"], sorted(rows, key=lambda r: int(r[0].split()[1]))))
    return s


def serving(c, runs: list, out: Path) -> Section:
    s = Section("Serving (production acceptance)")
    if not runs:
        s.text.append("Not served yet: `user_config.drafter: models:/...` in a Serve config.")
        return s
    rows, series = [], {}
    for r in runs:
        hist = c.get_metric_history(r.info.run_id, "spec_decode/mean_accepted_length")
        rate = c.get_metric_history(r.info.run_id, "spec_decode/draft_acceptance_rate")
        label = f"{r.data.tags.get('app', '?')} {r.info.run_id[:6]}"
        mean = sum(p.value for p in hist) / len(hist) if hist else None
        rows.append([label, r.info.status.lower(), _when(r.info.start_time), str(len(hist)),
                     f"{mean:.2f}" if mean is not None else "-",
                     f"{sum(p.value for p in rate) / len(rate):.1%}" if rate else "-"])
        if hist:
            t0 = r.info.start_time
            series[label] = [((p.timestamp - t0) / 60000, p.value) for p in hist]
    s.tables.append((["replica run", "status", "started", "reports", "mean accepted length", "draft acceptance"], rows))
    if series:
        s.images.append(_plot(out / "serving.png", "accepted length per step while served", "minutes since start",
                              "tokens per step", series))
    return s


def loadtests(c, runs: list, out: Path) -> Section:
    s = Section("Load tests (flexdraft loadtest)")
    series = {}
    for r in runs:
        hist = sorted((p.step, p.value) for p in c.get_metric_history(r.info.run_id, "speedup"))
        if hist:
            series[(f"{r.data.params.get('dataset', '?')} {_when(r.info.start_time)}",
                    r.data.tags.get("flexdraft.app", "?"))] = dict(hist)
    if not series:
        s.text.append("No load test against a baseline yet: `flexdraft loadtest --url ... --baseline ...`.")
        return s
    levels = sorted({level for per in series.values() for level in per})
    s.text.append("Served tok/s over the baseline endpoint's (the same app in AR mode, as `make demo` runs it), "
                  "by concurrency.")
    s.tables.append((["run", "app"] + [f"concurrency {level}" for level in levels],
                     [[run, app] + [f"{per[level]:.2f}x" if level in per else "-" for level in levels]
                      for (run, app), per in series.items()]))
    s.images.append(_plot(out / "loadtest.png", "served speed-up over AR by concurrency", "concurrency", "x AR",
                          {run: sorted(per.items()) for (run, _), per in series.items()}, log_x=True))
    return s


def _plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
          log_x: bool = False) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if "x AR" in ylabel:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)
    return path.name


def _markdown(title: str, sections: list[Section]) -> str:
    out = [f"# {title}", ""]
    for s in sections:
        out += [f"## {s.title}", ""] + [t + "\n" for t in s.text]
        for header, rows in s.tables:
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows] + [""]
        out += [f"![{img}]({img})\n" for img in s.images]
    return "\n".join(out)


def _html(title: str, sections: list[Section]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>"]
    for s in sections:
        body.append(f"<h2>{e(s.title)}</h2>")
        body += ["<p>" + re.sub(r"`([^`]+)`", r"<code>\1</code>", e(t)) + "</p>" for t in s.text]
        for header, rows in s.tables:
            body.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
                        + "</table>")
        body += [f'<img src="{e(img)}" alt="{e(img)}">' for img in s.images]
    style = ("body{font-family:sans-serif;max-width:60rem;margin:2rem auto;color:#222}table{border-collapse:collapse;"
             "margin:.5rem 0}td,th{border:1px solid #ccc;padding:.25rem .6rem;text-align:left;font-size:.9rem}"
             "th{background:#f3f3f3}img{max-width:100%;display:block;margin:.5rem 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{style}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def write_report(ref: str, out: str | Path | None = None) -> Path:
    """-> the HTML page (report.md and the plots beside it), also logged to MLflow."""
    import mlflow

    from flexdraft.core.tracking import start_run

    c = client()
    v = lookup(ref, c)
    folder = Path(out).expanduser() if out else data_dir() / "reports" / f"{v.name}-v{v.version}"
    folder.mkdir(parents=True, exist_ok=True)
    found = measured_with(c, v)
    sections = [lineage(c, v, found["serve"], found["loadtest"]), validation(v), benchmark(found["bench"], folder),
                sweep(c, v), serving(c, found["serve"], folder), loadtests(c, found["loadtest"], folder)]
    title = f"Drafter {v.uri}" + (f" (@{', @'.join(v.aliases)})" if v.aliases else "")
    (folder / "report.md").write_text(_markdown(title, sections))
    page = folder / "report.html"
    page.write_text(_html(title, sections))
    with start_run("flexdraft-reports", {"ref": ref, "version": v.uri}, run_name=f"report-{v.name}-v{v.version}") as run:
        mlflow.set_tags({"flexdraft.drafter_version": v.uri, "flexdraft.drafter_model_id": v.model_id})
        mlflow.log_artifacts(str(folder))
    set_tags(v, {"report.last_run": run.info.run_id})
    return page
