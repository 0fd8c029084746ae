"""The quiet terminal of long commands (cli/console.py): FlexDraft's lines on the terminal, everything in a log."""
import os
import re
import signal
import time

import pytest

from flexdraft.cli import console
from flexdraft.cli.main import build_parser

# lines as `make demo` printed them (Ray actors' prefixes and colours, Ray's and MLflow's log lines, tqdm bars with
# their carriage returns, warnings with their source line, a Ray Tune table), each with what the terminal shows
C, E = "\x1b[36m", "\x1b[0m"
DEMO = [
    ("=== [1/4] train a drafter", "=== [1/4] train a drafter"),
    ("2026-12-04 10:05:22,012\tINFO worker.py:2029 -- Started a local Ray instance. View the dashboard at "
     "\x1b[1m\x1b[32mhttp://127.0.0.1:8265 \x1b[39m\x1b[22m", None),
    ("\rLoading weights:   0%|          | 0/272 [00:00<?, ?it/s]\rLoading weights: 100%|#####| 272/272", None),
    ("[distill] shard train-00000.parquet done (2/7)", "[distill] shard train-00000.parquet done (2/7)"),
    ("2026/12/04 10:07:16 INFO mlflow.store.db.utils: Creating initial MLflow database tables...", None),
    ("[2026-12-04 10:07:50,194] [INFO] [real_accelerator.py:260:get_accelerator] Setting ds_accelerator to cpu", None),
    (f"{C}(TrainController pid=4381){E} Requesting resources: {{'CPU': 1}} * 2", None),
    (f"{C}(RayTrainWorker pid=4575){E} DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", None),
    (f"{C}(RayTrainWorker pid=4575){E} [attention] step 10/41 loss 7.040", "[attention] step 10/41 loss 7.040"),
    (f"{C}(RayTrainWorker pid=4601, ip=10.0.0.2){E} Reporting training result 1: TrainingReport(checkpoint=None)",
     None),
    (f"{C}(decode_trial pid=22496){E} [engine] profiling forwards [repeated 2x across cluster]",
     "[engine] profiling forwards"),
    ("/x/sqlalchemy_store.py:327: SADeprecationWarning: The ``noload`` loader strategy is deprecated", None),
    ("  sqlalchemy.orm.configure_mappers()", None),
    ("", ""),
    ("", None),
    ("Trial status: 1 RUNNING", None),
    ("│ decode_trial_b3c7f_00000   RUNNING    ...': 8, 'block': 0} │", None),
    ("Trial decode_trial_b3c7f_00000 completed after 3 iterations.", "Trial decode_trial_b3c7f_00000 completed after 3 iterations."),
    ("| method | batch 1 | batch 16 |", "| method | batch 1 | batch 16 |"),
    ("  two apps up in 91 s: adaptive at http://127.0.0.1:8000/v1", "  two apps up in 91 s: adaptive at http://127.0.0.1:8000/v1"),
    ("Traceback (most recent call last):", "Traceback (most recent call last):"),
]


def test_the_terminal_shows_flexdraft_lines_and_drops_library_output():
    """Each line of a real demo's output is shown (without Ray's actor prefix and dedup tail) or dropped as marked:
    our stage lines, tables and a driver's traceback stay; logs, bars, warnings, Ray and Tune internals go; blank
    lines never come twice in a row."""
    keep = console.Filter()
    keep.blank = False  # as after a line shown
    for raw, shown in DEMO:
        assert keep(raw + "\n") == shown, raw


@pytest.mark.parametrize("argv,quiet", [(["demo"], True), (["demo", "--verbose"], False), (["cluster", "up"], True),
                                        (["cluster", "env"], False), (["generate", "--prompt", "hi"], False),
                                        (["sweep"], True), (["loadtest"], True), (["pipeline"], True)])
def test_long_commands_are_quiet_unless_verbose_and_evald_output_is_never(monkeypatch, argv, quiet):
    """Long commands go through the log filter; --verbose, FLEXDRAFT_VERBOSE=1 and the filter's own child do not,
    nor `cluster env` (its stdout is eval'd by a shell) or short commands."""
    monkeypatch.delenv("FLEXDRAFT_VERBOSE", raising=False)
    monkeypatch.delenv(console.CHILD, raising=False)
    args = build_parser().parse_args(argv)
    assert console.wanted(args) is quiet
    monkeypatch.setenv("FLEXDRAFT_VERBOSE", "1")
    assert console.wanted(args) is False


def test_a_failing_command_shows_its_error_and_the_log_holds_everything(tmp_path, monkeypatch, capsys):
    """A real child (`flexdraft bench` on a config with an unknown key): exit status 2, the one-line error on the
    terminal, then the log's path; the log under $FLEXDRAFT_HOME/logs holds the child's whole output."""
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path))
    bad = tmp_path / "bench.yaml"
    bad.write_text("batch_size: [1]\n")
    assert console.run_quiet(["bench", "--config", str(bad)], "bench") == 2
    out, err = capsys.readouterr()
    assert re.search(r"flexdraft: error: .*batch_size", out)
    log, = (tmp_path / "logs").glob("bench-*.log")
    assert str(log) in err and "flexdraft: error:" in log.read_text()


def test_the_command_ending_ends_the_wait_even_if_a_process_it_left_holds_the_pipe(tmp_path, monkeypatch, capsys):
    """A command that leaves a process running with its stdout (as a daemon it started could): run_quiet returns
    the command's status as soon as the command ends, with its lines shown, instead of waiting for the pipe."""
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    (tmp_path / "leaver.py").write_text(
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(f'[leaver] left {p.pid} running', flush=True)\n"
        "sys.exit(3)\n")
    t0 = time.time()
    assert console.run_quiet([], "leaver", module="leaver") == 3
    assert time.time() - t0 < 30
    out = capsys.readouterr().out
    pid = int(re.search(r"\[leaver\] left (\d+) running", out)[1])
    os.kill(pid, signal.SIGKILL)
