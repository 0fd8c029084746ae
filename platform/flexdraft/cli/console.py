"""The terminal of a long command: FlexDraft's own lines, with the libraries' output in a log file.

`flexdraft demo | pipeline | sweep | bench | loadtest | cluster up` run themselves again as a child process whose
stdout and stderr come through `run_quiet`: every line goes to the log (named on the first line), and the
terminal gets the command's own lines, the `[stage] ...` lines of its Ray actors without Ray's `(Actor pid=N)`
prefix, and anything the driver prints that is not a library's log, warning, progress bar or Ray Tune table. A
real failure still prints (the error, or the driver's traceback) followed by the log's path; Ctrl-C stops the
command as it would without the filter. `--verbose`, or FLEXDRAFT_VERBOSE=1, runs the command in this process
with everything shown.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CHILD = "FLEXDRAFT_CONSOLE_CHILD"  # set in the child: it prints everything, the parent filters

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `(RayTrainWorker pid=4575)` or `(decode_trial pid=1, ip=10.0.0.2)`, then the actor's line
_ACTOR = re.compile(r"^\((?P<actor>[\w.:-]+) pid=\d+(?:, ip=[\d.]+)?\) (?P<line>.*)$")
_OURS = re.compile(r"^\[[a-z][\w-]*\] ")  # FlexDraft's log format (core/logs.py)
_NOISE = [re.compile(p) for p in (
    r"^\[?\d{4}[-/]\d\d[-/]\d\d[ T]\d\d:\d\d:\d\d",  # timestamped library logs: Ray, MLflow, DeepSpeed, absl
    r"^\S+\.py:\d+: \w*Warning: ",  # warnings.warn (its source line follows, indented: dropped below)
    r"\d+%\|", r"\d+(\.\d+)?(it|s)/(s|it)\]",  # tqdm progress bars
    r"^[│╭├╰┌└]",  # Ray Tune's status tables
    r"^(Trial status:|Current time:|Logical resource usage:|View detailed results here|To visualize your results"
    r"|Trial \S+ started with configuration:|Wrapping up|Training (started|finished))",
)]
_RAY_TAIL = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")


class Filter:
    """Decides, line by line, what the terminal shows of a child's merged stdout and stderr."""

    def __init__(self) -> None:
        self.after_warning = False
        self.blank = True  # no blank line at the start, none twice in a row

    def __call__(self, raw: str) -> str | None:
        line = _RAY_TAIL.sub("", _ANSI.sub("", raw.rstrip("\n")))
        warning_source, self.after_warning = self.after_warning and line.startswith("  "), False
        if warning_source or "\r" in line:
            return None
        actor = _ACTOR.match(line)
        if actor:  # a Ray actor's line: only FlexDraft's own
            line = actor["line"]
            return line if _OURS.match(line) else None
        if any(p.search(line) for p in _NOISE):
            self.after_warning = "Warning: " in line
            return None
        if not line.strip():
            if self.blank:
                return None
            self.blank = True
            return ""
        self.blank = False
        return line


def wanted(args) -> bool:
    """Whether this invocation of a long command goes through `run_quiet` (not in its own child, not verbose)."""
    console = getattr(args, "console", False)
    return (bool(console(args) if callable(console) else console) and not args.verbose
            and not os.environ.get(CHILD) and os.environ.get("FLEXDRAFT_VERBOSE", "") in ("", "0"))


def log_path(command: str) -> Path:
    from flexdraft.core.config import data_dir

    return data_dir() / "logs" / f"{command.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}.log"


def run_quiet(argv: list[str], command: str, module: str = "flexdraft.cli.main") -> int:
    """Run `python -m module argv` (the flexdraft command) as a child, teeing it into a log file and the filtered
    lines onto stdout; -> its exit status. The child runs in its own session: a Ctrl-C (or SIGTERM, SIGHUP) reaches
    it once, forwarded from here, so the cleanup it starts on the first is not cut short by the terminal signalling
    its Ray processes too. Its end ends the wait: a process it left running that still holds the pipe is not waited
    for."""
    log = log_path(command)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[flexdraft] the libraries' output (Ray, DeepSpeed, MLflow, transformers) goes to {log}; "
          f"--verbose shows it here", file=sys.stderr, flush=True)
    env = dict(os.environ, **{CHILD: "1", "PYTHONUNBUFFERED": "1"})
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in forwarded}
    with open(log, "w", buffering=1) as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, text=True, errors="replace", bufsize=1,
                                start_new_session=True)
        reader = threading.Thread(target=_pump, args=(proc.stdout, out, Filter()), name="flexdraft-console",
                                  daemon=True)
        try:
            for sig in forwarded:
                signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
            reader.start()
            code = proc.wait()
            reader.join(timeout=5)  # what the child printed last
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if code not in (0, 130):
        print(f"[flexdraft] {command} failed (exit status {code}); everything it printed: {log}", file=sys.stderr)
    return code


def _pump(stream, log, keep: Filter) -> None:
    """Every line into the log, the kept ones onto stdout, until the pipe closes (or the log does: the command
    has ended and `run_quiet` returned)."""
    try:
        for raw in stream:
            log.write(raw)
            shown = keep(raw)
            if shown is not None:
                print(shown, flush=True)
    except ValueError:  # the log was closed under us
        pass
