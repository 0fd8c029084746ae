"""A benchmark's results as a person reads them: the summary of speed-ups, the noise floor, Markdown tables
and plots (`flexdraft bench` writes them beside results.json)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from flexdraft.core.data import BENCH_DATASETS
from flexdraft.evaluation.bench import markdown
from flexdraft.evaluation.methods import METHODS, speculative


def summary(rows: list[dict], key: str = "speedup_ar") -> dict[str, dict[int, float]]:
    """method -> batch -> speed-up over our AR (key: or over the best peer, `speedup_peer`), mean over the
    datasets (the paper's 'mean')."""
    acc: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if "skipped" not in r and r.get(key) is not None:
            acc.setdefault(r["method"], {}).setdefault(r["batch"], []).append(r[key])
    return {m: {b: statistics.mean(v) for b, v in per.items()} for m, per in acc.items()}


def noise_floor(rows: list[dict]) -> str:
    """What `ar-control` (the same work as `ar`, in the same lockstep) measured against `ar`, as a sentence."""
    ratios = [r["speedup_ar"] for r in rows if r["method"] == "ar-control" and "skipped" not in r]
    if not ratios:
        return ""
    return (f"Noise floor: `ar-control`, our AR again on the same prompts, measured {min(ratios):.2f}-"
            f"{max(ratios):.2f}x of `ar` over {len(ratios)} cell(s) (mean {statistics.mean(ratios):.2f}x): read "
            "differences between methods within that range as this machine's noise, not as a speed-up or loss.")


def _modes(row: dict) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in sorted(row.get("mode_share", {}).items(), key=lambda kv: -kv[1]))


def line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['method']:>22}: skipped ({r['skipped']})"
    hf = f", x{r['speedup_hf']:.2f} over transformers" if r.get("speedup_hf") else ""
    hf += f", x{r['speedup_peer']:.2f} over the best peer" if r.get("speedup_peer") else ""
    extra = f", steps {_modes(r)}" if speculative(r["method"]) else ""
    extra += f", mean acceptance length {r['acceptance_length']:.2f}" if r.get("acceptance_length") else ""
    extra += f", pruned misses {r['pruned_misses']:.0%}" if "parallel" in r.get("mode_share", {}) else ""
    return (f"{r['method']:>22}: {r['tok_s']:7.1f} tok/s, x{r['speedup_ar']:.2f} over AR{hf}, tau {_tau(r)}, "
            f"mismatched rows {_mismatched(r)}{extra}")


def _tau(r: dict) -> str:
    return "n/a" if r.get("tau") is None else f"{r['tau']:.2f}"


def _mismatched(r: dict) -> str:
    return "n/a (sampled)" if r["mismatched_rows"] is None else f"{r['mismatched_rows']}/{r['prompts']}"


def save_figure(fig, path: Path) -> Path:
    """A finished matplotlib figure as a PNG at `path` (the harness's and the sweeps' plots alike)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def summary_table(results: dict, key: str = "summary") -> str:
    """The mean speed-ups over our AR (key "vs_peer": over the best peer's tokens/s in each cell)."""
    batches = results["config"]["batch_sizes"]
    title = "over the best peer (the fastest of the peers' modes in each cell)" if key == "vs_peer" else "over our AR"
    return markdown(f"**Speed-up {title}, mean over the datasets**", ["method"] + [f"batch {b}" for b in batches],
                    [[m] + [f"{per[b]:.2f}x" if b in per else "n/a" for b in batches]
                     for m, per in results[key].items()])


def report(results: dict) -> str:
    cfg, hw = results["config"], results["hardware"]
    sampled = f"sampled (temperature {cfg['temperature']}, top-p {cfg['top_p']})"
    decoding = sampled if cfg["temperature"] else "greedy"
    lines = [f"# FlexDraft benchmark, {results['date']}", "",
             f"* Machine: {hw.get('gpu') or hw['cpu']} ({hw['cpu_count']} CPUs, {hw['torch_threads']} torch threads), "
             f"{hw.get('cpu_isa', '')}, {results['device']}, {results.get('dtype', cfg['dtype'])} ({results['attention']} "
             f"attention), `dtype: {cfg['dtype']}`, prepacked weights {results.get('prepacked')}; model {cfg['model']}; "
             f"drafter {results['drafter'] or 'none'}; "
             f"n-gram store {results.get('store') or 'none'}; commit {results['git_commit']}.",
             f"* Prompts: a seeded sample (seed {cfg['seed']}) of max({cfg['samples']}, batch) per dataset and batch "
             f"size, chat template, {decoding}, up to {cfg['max_new_tokens']} new tokens, EOS respected; MT-Bench's "
             f"second turn follows the model's own first answer (up to {cfg['answer_tokens']} tokens).",
             f"* Timing: model loading excluded, prefill included, one warm-up per cell, median of {cfg['repeats']} "
             f"repeat(s); speed-ups are tokens/s ratios measured in the same run ({results['seconds'] / 60:.1f} min "
             "in all). tau: tokens per target forward after the prefill.",
             "* Correctness: every output is compared with our AR's, token for token (mismatched rows below)."
             if not cfg["temperature"] else "* Correctness: sampled outputs are not compared with AR's (they differ "
             "draw for draw); the engine's tests check that speculative sampling keeps the target's distribution."]
    lines.append("* Datasets: " + "; ".join(f"`{d}` ({BENCH_DATASETS[d].title}, package {BENCH_DATASETS[d].source})"
                                           for d in cfg["datasets"] if d in BENCH_DATASETS) + ".")
    about = {m: METHODS[m].about if m in METHODS else f"the policy file {cfg['policies'][m]}"
             if m in cfg.get("policies", {}) else f"the proposer {m}'s drafts alone" for m in cfg["methods"]}
    lines.append("* Methods: " + "; ".join(f"`{m}` ({about[m]})" for m in cfg["methods"]) + ".")
    if results["unavailable"]:
        lines.append("* Not run, nothing substituted: " + "; ".join(f"{d} ({why})" for d, why in
                                                                    results["unavailable"].items()) + ".")
    if results.get("peers"):
        lines.append("* Peers: " + "; ".join(f"`{n}` ({p['version']}, `{json.dumps(p['flags'])}`)"
                                             for n, p in results["peers"].items()) + ".")
    lines += ["", summary_table(results), ""]
    if results.get("vs_peer"):
        lines += [summary_table(results, "vs_peer"), ""]
    if results["noise_floor"]:
        lines += [results["noise_floor"], ""]
    cells = []
    for r in results["rows"]:
        if "skipped" in r:
            continue
        acc = " ".join(f"{a:.2f}" for a in (r.get("acceptance") or [])[:4] if a is not None)
        cells.append([r["dataset"], r["batch"], r["method"], f"{r['tok_s']:.1f}", f"{r['speedup_ar']:.2f}x",
                      f"{r['speedup_hf']:.2f}x" if r.get("speedup_hf") else "n/a",
                      f"{r['speedup_peer']:.2f}x" if r.get("speedup_peer") else "n/a", _tau(r),
                      _mismatched(r), acc, _modes(r) if speculative(r["method"]) else "",
                      f"{r['pruned_misses']:.0%}" if "parallel" in r.get("mode_share", {}) else ""])
    lines.append(markdown("**Per dataset and batch size** (acceptance: P(draft j accepted | drafts before it accepted), "
                          "j = 1..4; steps: share of engine steps per mode)",
                          ["dataset", "batch", "method", "tok/s", "x our AR", "x transformers", "x best peer", "tau",
                           "mismatched rows",
                           "acceptance", "steps", "pruned misses"], cells))
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> list[Path]:
    """speedup_vs_batch.png (per dataset), tau_hist.png (tokens per verify step, batch 1), acceptance.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "skipped" not in r]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    title = f"{results['config']['model']}, {results['config']['dtype']}, {results['device']}"
    paths = []

    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.8), squeeze=False, sharey=True)
    for ax, d in zip(axes[0], datasets):
        for m in methods:
            pts = sorted((r["batch"], r["speedup_ar"]) for r in rows if r["dataset"] == d and r["method"] == m)
            style = ":" if m == "ar-control" else "--" if m.startswith("hf") else "-"
            ax.plot(*zip(*pts), marker="o", label=m, linestyle=style)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["config"]["batch_sizes"], [str(b) for b in results["config"]["batch_sizes"]])
        ax.set_title(d)
        ax.set_xlabel("batch size")
    axes[0][0].set_ylabel("speed-up over our AR (tokens/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Speed-up vs batch size ({title})")
    paths.append(save_figure(fig, out / "speedup_vs_batch.png"))

    spec = [m for m in methods if speculative(m)]
    b1 = min(r["batch"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for m in spec:
        lengths = [a + 1 for r in rows if r["method"] == m and r["batch"] == b1 for a in r["accepted"]]
        if lengths:
            ax.hist(lengths, bins=range(1, max(lengths) + 2), histtype="step", density=True, linewidth=1.5,
                    label=f"{m} (mean {statistics.mean(lengths):.2f})", align="left")
    ax.set_xlabel("tokens per verify step (accepted drafts + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title(f"Tokens per step, batch {b1}, all datasets")
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "tau_hist.png"))

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for m in spec:
        taken = [r for r in rows if r["method"] == m and r["batch"] == b1 and r.get("acceptance")]
        if taken:
            per_pos = []
            for j in range(len(taken[0]["acceptance"])):
                seen = [r["acceptance"][j] for r in taken if r["acceptance"][j] is not None]
                per_pos.append(statistics.mean(seen) if seen else float("nan"))
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=m)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(accepted | earlier drafts accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Acceptance per position, batch {b1}, mean over datasets")
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "acceptance.png"))
    plt.close("all")
    return paths
