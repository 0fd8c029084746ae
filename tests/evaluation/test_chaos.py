"""`flexdraft loadtest --chaos` passes only a run in which the replica took no harm: each kind of harm on its own
makes an otherwise clean report fail, naming it."""
import copy
import json
from collections import Counter

import pytest

from flexdraft.evaluation.chaos import CLASSES, ChaosReport, summary
from flexdraft.evaluation.chaos_options import ATTACKS, judge

HEALTH = {"alive": True, "replica": "r1", "failed_steps": 3, "running": 0, "waiting": 0, "streams": 0, "rss_mb": 900}


def clean() -> ChaosReport:
    """What a harmless run reports: every class tried, valid requests 200, the rest 4xx or left on purpose."""
    statuses = {"valid": {"200": 9}, "out_of_range": {"400": 5, "404": 1}, "wrong_type": {"400": 6},
                "malformed": {"400": 6}, "oversized": {"413": 4}, "disconnect": {"left": 5},
                "options": {"200": 3, "400": 4}}
    tried = Counter({kind: sum(by.values()) for kind, by in statuses.items()})
    return ChaosReport(tried=tried, statuses=statuses, before=dict(HEALTH), after={**HEALTH, "rss_mb": 950},
                       probe_unchanged=True, seconds=12.0, neighbour_ttft_s=0.8)


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
    elif kind == "an option attack answered wrongly":
        r.option_failures.append("ref chain 3000: HTTP 500")
    elif kind == "a starved neighbour":
        r.neighbour_ttft_s = r.ttft_budget_s + 1
    elif kind == "a neighbour never answered":
        r.neighbour_ttft_s = None
    return r


KINDS = ["a dropped connection", "a 503", "a 4xx to a valid request", "a failed step", "a class not tried", "a 5xx",
         "a hung request", "an engine death", "a replaced replica", "a leaked stream", "RSS past its budget",
         "a changed probe", "an option attack answered wrongly", "a starved neighbour", "a neighbour never answered"]


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


def _sse(*events) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def test_an_option_attack_passes_only_with_the_answer_it_must_get():
    """A 400 must name the attacked field; a 200 under a grammar must parse (and validate) in every choice that
    ended with "stop" (one cut by max_tokens is not judged), streamed or not; an error event or a missing choice
    fails; so does a 200 where a 400 was due."""
    by = {a.name: a for a in ATTACKS}
    answer = lambda attack, status, raw: judge(attack, attack.options, status, raw)  # noqa: E731
    chain, mins, streamed = by["ref chain 3000"], by["json_object + min_tokens"], \
        by["json_object + ignore_eos, n 2 sampled streamed"]
    error = lambda param: json.dumps({"error": {"message": "m", "param": param}}).encode()  # noqa: E731
    assert answer(chain, 400, error("response_format")) is None
    assert "naming 'prompt'" in answer(chain, 400, error("prompt"))
    assert answer(chain, 200, b"{}") == "HTTP 200" and answer(chain, 500, b"") == "HTTP 500"
    whole = lambda *cs: json.dumps({"choices": [{"index": i, "text": t, "finish_reason": f}  # noqa: E731
                                                for i, (t, f) in enumerate(cs)]}).encode()
    assert answer(mins, 200, whole(('{"a": 1}', "stop"))) is None
    assert answer(mins, 200, whole(('{"a": 1', "length"))) is None
    assert "does not parse" in answer(mins, 200, whole(('{}\n\n__ **###', "stop")))
    assert "not an object" in answer(mins, 200, whole(("[1]", "stop")))
    chunk = lambda i, t, f=None: {"choices": [{"index": i, "text": t, "finish_reason": f}]}  # noqa: E731
    assert answer(streamed, 200, _sse(chunk(0, "{"), chunk(1, "{}", "stop"), chunk(0, "}", "stop"))) is None
    broken = _sse(chunk(0, "{}S"), chunk(0, "you", "stop"), chunk(1, "{}", "stop"))  # (text after the value)
    assert "does not parse" in answer(streamed, 200, broken)
    assert answer(streamed, 200, _sse(chunk(0, "{}", "stop"))) == "1 choices"
    assert "error event" in answer(streamed, 200, _sse(chunk(0, "{"), {"error": {"message": "grammar failed"}}))
