"""`flexdraft loadtest --chaos` passes only a run in which the replica took no harm: each kind of harm on its own
makes an otherwise clean report fail, naming it."""
import copy
from collections import Counter

import pytest

from flexdraft.evaluation.chaos import CLASSES, ChaosReport, summary

HEALTH = {"alive": True, "replica": "r1", "failed_steps": 3, "running": 0, "waiting": 0, "streams": 0, "rss_mb": 900}


def clean() -> ChaosReport:
    """What a harmless run reports: every class tried, valid requests 200, the rest 4xx or left on purpose."""
    statuses = {"valid": {"200": 9}, "out_of_range": {"400": 5, "404": 1}, "wrong_type": {"400": 6},
                "malformed": {"400": 6}, "oversized": {"413": 4}, "disconnect": {"left": 5}}
    tried = Counter({kind: sum(by.values()) for kind, by in statuses.items()})
    return ChaosReport(tried=tried, statuses=statuses, before=dict(HEALTH), after={**HEALTH, "rss_mb": 950},
                       probe_unchanged=True, seconds=12.0)


def harm(report: ChaosReport, kind: str) -> ChaosReport:
    r = copy.deepcopy(report)
    if kind == "a dropped connection":
        r.statuses["valid"]["error:RemoteProtocolError"] = 1
    elif kind == "a 503":
        r.statuses["out_of_range"]["503"] = 1
    elif kind == "a 4xx to a valid request":
        r.statuses["valid"]["400"] = 1
    elif kind == "a failed step":
        r.after["failed_steps"] += 1
    elif kind == "a class not tried":
        r.tried["oversized"], r.statuses["oversized"] = 0, {}
    elif kind == "a 5xx":
        r.server_errors = 1
    elif kind == "a hung request":
        r.hung = 1
    elif kind == "an engine death":
        r.after["alive"] = False
    elif kind == "a replaced replica":
        r.after["replica"] = "r2"
    elif kind == "a leaked stream":
        r.after["streams"] = 1
    elif kind == "RSS past its budget":
        r.after["rss_mb"] = r.before["rss_mb"] + r.rss_budget_mb + 1
    elif kind == "a changed probe":
        r.probe_unchanged = False
    return r


KINDS = ["a dropped connection", "a 503", "a 4xx to a valid request", "a failed step", "a class not tried", "a 5xx",
         "a hung request", "an engine death", "a replaced replica", "a leaked stream", "RSS past its budget",
         "a changed probe"]


def test_a_clean_run_passes():
    report = clean()
    assert set(report.tried) == set(CLASSES)
    assert report.ok() and report.problems() == [] and summary(report).endswith(": PASS")


@pytest.mark.parametrize("kind", KINDS)
def test_each_harm_alone_fails_the_run_and_is_named(kind):
    report = harm(clean(), kind)
    assert not report.ok()
    assert len(report.problems()) == 1, report.problems()
    assert "FAIL: " + report.problems()[0] in summary(report)
