"""The README and docs/ say only what this repository can do: every `flexdraft` command they show parses with the
real CLI parser, every repository path they name or link exists, and none points outside the repository."""
import json
import re
import shlex
from pathlib import Path

from flexdraft.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIBRARY = ROOT / "platform" / "flexdraft"
# the repository's folders and the library's (docs name library modules from its root, e.g. `engine/engine.py`)
FOLDERS = sorted({p.name for p in [*ROOT.iterdir(), *LIBRARY.iterdir()] if p.is_dir() and not p.name.startswith(("_", "."))})


def commands(text: str) -> list[str]:
    """`flexdraft ...` lines of shell blocks (continuations joined, comments and pipes cut) and inline code."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("flexdraft "):
                found.append(line)
    found += re.findall(r"`(flexdraft [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    cut = lambda c: re.split(r"\s+#\s|\s+(?:\||&&|>|;)\s", c)[0].removesuffix(" ...").strip()
    return [cut(c) for c in found]


def test_every_flexdraft_command_in_the_docs_parses():
    """Each command a reader may copy parses: a subcommand that exists, flags it has, values of the right type
    (a bare command name, e.g. "`flexdraft cluster`" in prose, is a reference and may stand alone)."""
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    checked, bad = 0, []
    for doc in DOCS:
        for command in commands(doc.read_text()):
            argv = shlex.split(command)[1:]
            if len(argv) == 1 and argv[0] in subcommands:
                continue
            try:
                build_parser().parse_args(argv)
                checked += 1
            except SystemExit:
                bad.append(f"{doc.relative_to(ROOT)}: {command}")
    assert not bad, "commands the CLI does not take:\n" + "\n".join(bad)
    assert checked > 40  # the extraction finds the docs' commands (README alone shows ~25)


def test_every_path_the_docs_name_exists_and_none_points_outside_the_repository():
    """Relative links resolve from the document's folder, backticked paths from the repository's or the library's
    root; no
    document names a machine path (/work, /home) or a folder beside the repository (../shared)."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"`((?:" + "|".join(FOLDERS) + r")/[^`\s*<>{}$]*)`", text):
            if not any((root / path.rstrip(".,:")).exists() for root in (ROOT, LIBRARY)):
                missing.append(f"{doc.relative_to(ROOT)}: path {path}")
        for outside in re.findall(r"\.\./shared|/work/\S*|/home/\S*", text):
            missing.append(f"{doc.relative_to(ROOT)}: outside the repository: {outside}")
    assert not missing, "\n".join(missing)


# --- figures: each README figure against the results file it cites ------------------------------------------------

RESULTS = ROOT / "docs" / "results"


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a text, as rows keyed by the header's cells (bold marks dropped)."""
    tables, current, header = [], None, None
    for line in text.splitlines() + [""]:
        cells = [c.replace("**", "").strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            current = header = None
        elif header is None:
            header, current = cells, []
            tables.append(current)
        elif not set(line) <= set("|-: "):
            current.append(dict(zip(header, cells)))
    return tables


def table(path: Path, first_header: str, *others: str) -> list[dict[str, str]]:
    """The file's first table whose header starts with these cells."""
    want = [first_header, *others]
    for t in md_tables(path.read_text()):
        if t and list(t[0])[:len(want)] == want:
            return t
    raise AssertionError(f"{path.relative_to(ROOT)}: no table with header {want}")


def summary(path: Path, after: str) -> dict[str, list[str]]:
    """A harness summary table (method | batch 1 | ...), the first after the line `after`: method -> its cells."""
    text = path.read_text()
    assert after in text, f"{path.relative_to(ROOT)}: no '{after}'"
    first = md_tables(text[text.index(after):])[0]
    return {row["method"]: [cell for key, cell in row.items() if key != "method"] for row in first}


def mismatched(path: Path, method: str) -> tuple[int, int]:
    """(rows that differ from our AR, rows) summed over a harness run's per-cell table for one method."""
    rows = [r for r in table(path, "dataset", "batch", "method") if r["method"] == method]
    pairs = [tuple(map(int, r["mismatched rows"].split("/"))) for r in rows]
    return sum(a for a, _ in pairs), sum(b for _, b in pairs)


def said(pattern: str, doc: str = "README.md") -> tuple[str, ...]:
    """The numbers a document states where `pattern` (a regex with groups) matches it."""
    text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
    found = re.search(pattern, text)
    assert found, f"{doc} no longer says /{pattern}/: update the claim and tests/test_docs.py together"
    return found.groups()


def peer_pairs(path: Path, batch: int) -> list[tuple[float, float]]:
    """(our AR's tok/s, vLLM AR's tok/s) per dataset at one batch size of a harness run's results.json."""
    tok = {(r["dataset"], r["method"]): r["tok_s"] for r in json.loads(path.read_text())["rows"]
           if r.get("batch") == batch and "tok_s" in r}
    return [(tok[d, "ar"], tok[d, "vllm"]) for d, m in tok if m == "ar"]


def before_after_span(path: Path) -> str:
    """'lo-hi' of after / before tok/s over a code | dataset | tok/s table's runs: per dataset, the slowest after
    over the fastest before, to the fastest after over the slowest before."""
    runs: dict[tuple[str, str], list[float]] = {}
    for r in table(path, "code", "dataset", "tok/s"):
        runs.setdefault((r["code"], r["dataset"]), []).append(float(r["tok/s"]))
    sets = {d for _, d in runs}
    lo = min(min(runs["after", d]) / max(runs["before", d]) for d in sets)
    hi = max(max(runs["after", d]) / min(runs["before", d]) for d in sets)
    return f"{lo:.2f}-{hi:.2f}"


def span(values: list[str]) -> str:
    """'lo-hi' of ratio cells such as ['1.18x', '0.97x']."""
    xs = [float(v.rstrip("x")) for v in values]
    return f"{min(xs):.2f}-{max(xs):.2f}"


DEMO, DEMO_RUN = RESULTS / "2026-12-02-demo" / "results.md", RESULTS / "2026-12-02-demo" / "README.md"
PEERS = RESULTS / "2026-12-06-peers"
KERNELS = RESULTS / "2026-12-06-kernels"
AMX = RESULTS / "2026-12-07-amx"
PREFILL = RESULTS / "2026-12-07-prefill"
AMX_ATTENTION = RESULTS / "2026-12-07-amx-attention"
BATCH16 = RESULTS / "2026-12-07-batch16"
SERVE, HTTP = RESULTS / "2026-12-04-serve" / "README.md", RESULTS / "2026-12-05-http" / "README.md"
HEADLINE_ROWS = {  # the README's headline table row -> the harness's method
    "`transformers` `generate` (same weights)": "hf-generate", "`transformers` prompt lookup": "hf-prompt-lookup",
    "sequential (draft after verify)": "sequential", "tree (sequential drafts as a token tree)": "tree",
    "parallel, pruned branches": "parallel-pruned", "prompt lookup + n-gram store (no drafter)": "lookup",
    "adaptive, drafter modes only (no lookup)": "adaptive-drafter", "adaptive (the product)": "adaptive",
    "`ar-control` (our AR again: the noise floor)": "ar-control"}


def readme_figures() -> list[tuple[str, tuple, tuple]]:
    """(claim, what the README says, what its results file holds) for every figure docs/claims.md lists."""
    readme = {r["method"]: [r["batch 1"], r["batch 4"], r["batch 16"]]
              for r in table(ROOT / "README.md", "method", "batch 1", "batch 4", "batch 16")}
    demo = summary(DEMO, "**Speed-up over our AR, mean over the datasets**")
    fp32 = summary(PEERS / "fp32" / "results.md", "**Speed-up over our AR, mean over the datasets**")
    xeon = summary(AMX_ATTENTION / "peers-bf16-stack" / "results.md", "**Speed-up over the best peer")
    paired = {dt: [f"{r['speedup']:.2f}x" for run in runs for r in json.loads((KERNELS / run).read_text())["generations"]]
              for dt, runs in (("bf16", ("ab-bfloat16.json", "ab-bfloat16-run2.json", "ab-bfloat16-run3.json")),
                               ("fp32", ("ab-float32.json",)))}
    step = {lever: [f"{r['speedup']:.2f}x" for r in json.loads((AMX / f"ab-{lever}.json").read_text())["generations"]]
            for lever in ("amx", "stack", "stack-float32")}
    served = table(SERVE, "concurrency", "learned / AR")
    http = table(HTTP, "concurrency", "learned / AR")
    shares = {(r["mode"], r["side"]): r["share of offline"] for r in table(HTTP, "mode", "side", "tok/s")}
    noise = re.search(r"measured ([\d.]+x?)-([\d.]+x?)x of `ar`", DEMO.read_text()).groups()
    first = "our replica / vLLM's tok/s"
    served_b16 = table(BATCH16 / "README.md", first, "c1", "c4", "c8", "c16")
    return [
        ("the headline table", tuple(tuple(readme[row]) for row in HEADLINE_ROWS),
         tuple(tuple(demo[m]) for m in HEADLINE_ROWS.values())),
        ("the headline run's noise floor", said(r"inside the run's ([\d.]+x?)-([\d.]+x?)x noise floor"), noise),
        ("the pipeline's training time", said(r"trained in ([\d.]+x?) min on 2 CPU"),
         re.search(r"\*\*([\d.]+x?) min\*\*", DEMO_RUN.read_text()).groups()),
        ("the drafter's validation tau", said(r"([\d.]+x?) with the bonus known, ([\d.]+x?) masked \+ calibrated, ([\d.]+x?) as a tree of 8"),
         re.search(r"\*\*([\d.]+x?)\*\* bonus known, .*?\*\*([\d.]+x?)\*\* masked \+ calibrated.*?\*\*([\d.]+x?)\*\* /", DEMO_RUN.read_text()).groups()),
        ("bf16 rows that differ from AR", said(r"(\d+) of (\d+) adaptive rows differ from AR's \(sequential and tree: (\d+) of (\d+);"
                                              r" `transformers`' own `generate` differs from our AR in (\d+) of (\d+) rows"),
         tuple(str(n) for m in ("adaptive", "sequential", "hf-generate") for n in mismatched(DEMO, m))),
        ("fp32 rows that differ from AR", said(r"\((\d+) of (\d+) adaptive rows differ on the EPYC"),
         tuple(map(str, mismatched(PEERS / "fp32" / "results.md", "adaptive")))),
        ("fp32 speed-ups", said(r"adaptive gave ([\d.]+x?) / ([\d.]+x?) at batch 1 / 16 against a ([\d.]+x?) / ([\d.]+x?) control"),
         (*fp32["adaptive"], *fp32["ar-control"])),
        ("beside vLLM on the Xeon", said(r"On the Intel Xeon with AMX \(bf16, C\+\+ kernels\): our AR ([\d.]+x) / ([\d.]+x), "
                                         r"adaptive ([\d.]+x) / ([\d.]+x)"), (*xeon["ar"], *xeon["adaptive"])),
        ("the C++ kernels, paired", said(r"the kernels alone, paired: ([\d.]+-[\d.]+)x tok/s in bf16, ([\d.]+-[\d.]+)x in fp32"),
         (span(paired["bf16"]), span(paired["fp32"]))),
        ("AMX tiles and the C++ layer stack, paired",
         said(r"then AMX tiles ([\d.]+-[\d.]+)x and the C\+\+ layer stack ([\d.]+-[\d.]+)x \(bf16; ([\d.]+-[\d.]+)x in fp32\)"),
         (span(step["amx"]), span(step["stack"]), span(step["stack-float32"]))),
        ("bf16 rows on AMX", said(r"and (\d+) of (\d+) adaptive rows differed from AR's beside vLLM on the Xeon"),
         tuple(map(str, mismatched(AMX_ATTENTION / "peers-bf16-stack" / "results.md", "adaptive")))),
        ("our AR against vLLM's AR on the Xeon", said(r"our AR ([\d.]+-[\d.]+)x vLLM's AR at batch 1 and ([\d.]+-[\d.]+)x at 16"),
         tuple(span([f"{ours / theirs:.2f}x" for ours, theirs in peer_pairs(AMX_ATTENTION / "peers-bf16-stack" / "results.json", b)])
               for b in (1, 16))),
        ("attention and the packed prefill, before and after", said(r"the packed prefill, ([\d.]+-[\d.]+)x at batch 16"),
         (before_after_span(PREFILL / "generations.md"),)),
        ("attention on AMX tiles, before and after", said(r"attention on AMX tiles, ([\d.]+-[\d.]+)x"),
         (before_after_span(AMX_ATTENTION / "generations.md"),)),
        ("served beside vLLM on the Xeon, adaptive and the AR control",
         said(r"adaptive ([\d.]+x) / ([\d.]+x) / ([\d.]+x) / ([\d.]+x) of vLLM's tok/s at concurrency 1 / 4 / 8 / 16, "
              r"the same replica in AR mode ([\d.]+x) / ([\d.]+x) / ([\d.]+x) / ([\d.]+x)"),
         tuple(cell for mode in ("adaptive", "AR") for row in served_b16 if row[first].startswith(f"{mode}, 2 s")
               for cell in (row["c1"], row["c4"], row["c8"], row["c16"]))),
        ("llama.cpp beside our AR on the Xeon", said(r"llama.cpp made ([\d.]+x) / ([\d.]+x) our AR's tok/s"),
         tuple(summary(BATCH16 / "peers-bf16" / "results.md", "**Speed-up over our AR, mean over the datasets**")["llama.cpp"])),
        ("served, 2026-12-04", said(r"gave ([\d.]+x) at concurrency 1 and ([\d.]+-[\d.]+)x at 2-16, where AR against itself moved ([\d.]+-[\d.]+)x"),
         (served[0]["learned / AR"], span([r["learned / AR"] for r in served[1:]]),
          span([r["ar2 / AR (noise)"] for r in served[1:]]))),
        ("served long documents", said(r"and ([\d.]+x?) on ShareGPT's long documents"),
         (table(SERVE, "concurrency", "learned / AR", "static / AR", "ar2 / AR (noise)", "learned TPOT p50 vs AR")[0]["learned / AR"],)),
        ("served, 2026-12-05", said(r"([\d.]+x) at concurrency 1 and ([\d.]+x) at 2, with (\d+%) \(AR\) and (\d+%) \(adaptive\)"),
         (http[0]["learned / AR"], http[1]["learned / AR"], shares["ar", "http"], shares["adaptive", "http"])),
    ]


def test_each_readme_figure_equals_its_results_file():
    """The README states each measured figure exactly as the results file it cites holds it (or as it follows from
    that file: a range over its rows, a count of its mismatched rows): editing either away from the other fails."""
    figures = readme_figures()
    wrong = [f"{claim}: the README says {readme}, its results file {source}"
             for claim, readme, source in figures if readme != source]
    assert not wrong, "\n".join(wrong)
    assert len(figures) == 19


def test_config_paths_in_documented_commands_exist():
    """Every `--config`, `--bench-config` or `--policy` path a documented command passes is a file of the
    repository (or a placeholder a reader fills in)."""
    missing = []
    for doc in [*DOCS, ROOT / "CONTRIBUTING.md"]:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for flag, path in re.findall(r"(--config|--bench-config|--policy)[ =]([^\s`'\"]+)", text):
            if (path.startswith(("~", "$", "/")) or "<" in path or "..." in path or path.isupper()
                    or "models:/" in path or re.search(rf"\bcp \S+ {re.escape(path)}", text)):
                continue  # a placeholder, a path on another machine, or a file the document has the reader make
            if not (ROOT / path).is_file() and not (doc.parent / path).is_file():
                missing.append(f"{doc.relative_to(ROOT)}: {flag} {path}")
    assert not missing, "\n".join(missing)
