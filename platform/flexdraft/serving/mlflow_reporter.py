"""A replica's serving run in MLflow: the AsyncEngine's rates over time, and a run state that follows the replica
(FINISHED when it shuts down, FAILED when its engine loop died, KILLED when a later replica of the same deployment
finds it gone without a heartbeat)."""
from __future__ import annotations

import threading
import time

from flexdraft.core import logs
from flexdraft.serving.async_engine import AsyncEngine

HEARTBEAT = "flexdraft.heartbeat"  # tag: epoch seconds of the run's last report
ENDED = "flexdraft.ended"  # tag: why a run was ended by someone other than its replica


class MlflowReporter:
    """A serving run in MLflow: the replica's config as params, then every `every_s` seconds the rates since the
    last report (tokens/s, steps/s, mean batch, mean accepted length, mode shares) and the load, at step = seconds
    since the start, so the dashboard shows the deployment over time. model_id: the served drafter's LoggedModel,
    which the spec_decode/ metrics are linked to (its page shows production acceptance beside validation). Its own
    thread; `stop()` ends the run."""

    def __init__(self, engine: AsyncEngine, params: dict, run_name: str, tags: dict | None = None,
                 experiment: str = "flexdraft-serve", every_s: float = 30.0, model_id: str | None = None):
        from mlflow.tracking import MlflowClient

        from flexdraft.core.tracking import experiment_id, flatten, ready_store

        self.engine, self.every_s, self.model_id = engine, every_s, model_id
        self.client = MlflowClient(ready_store())
        exp_id = experiment_id(self.client, experiment)
        tags = tags or {}
        self.ended = end_silent_runs(self.client, exp_id, tags, stale_s=3 * every_s + 30,
                                     by=tags.get("replica", run_name))
        self.run_id = self.client.create_run(exp_id, run_name=run_name,
                                             tags={**tags, HEARTBEAT: str(int(time.time()))}).info.run_id
        for key, value in list(flatten(params).items())[:100]:
            self.client.log_param(self.run_id, key, str(value)[:500])
        self.t0 = time.time()
        self._last = (self.t0, engine.stats())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flexdraft-mlflow", daemon=True)
        self._thread.start()

    def report(self) -> dict:
        """Log one point now -> the metrics logged."""
        now, totals = time.time(), self.engine.stats()
        t_prev, prev = self._last
        self._last = (now, totals)
        d = totals.delta(prev)
        dt, steps = max(now - t_prev, 1e-9), sum(d.steps_by_mode.values())  # decoding steps
        load = self.engine.load()
        metrics = {"serve/tokens_per_s": d.num_tokens / dt, "serve/steps_per_s": d.num_steps / dt,
                   **{f"serve/{k}": load[k] for k in ("running", "waiting", "streams")},
                   "serve/aborted_total": load["aborted"], "serve/failed_steps_total": load["failed_steps"]}
        if steps:
            metrics["serve/mean_batch"] = d.num_rows / steps
            for mode, n in d.steps_by_mode.items():
                metrics[f"serve/mode_share/{mode}"] = n / steps
        if d.num_drafts:
            metrics["spec_decode/mean_accepted_length"] = d.mean_accepted_length
            metrics["spec_decode/draft_acceptance_rate"] = d.draft_acceptance_rate
        from mlflow.entities import Metric, RunTag

        ts, step = int(now * 1000), int(now - self.t0)
        self.client.log_batch(self.run_id, tags=[RunTag(HEARTBEAT, str(int(now)))], metrics=[
            Metric(k, float(v), ts, step, model_id=self.model_id if k.startswith("spec_decode/") else None)
            for k, v in metrics.items()])
        return metrics

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.report()
            except Exception:  # noqa: BLE001 - a tracking hiccup must not stop serving
                logs.get("serve").exception("MLflow report failed")

    def stop(self, status: str = "FINISHED") -> None:
        """The last point, then the run ends with `status` (FINISHED, or FAILED for a replica whose engine died)."""
        self._stop.set()
        self._thread.join(5)
        try:
            self.report()
            self.client.set_terminated(self.run_id, status)
        except Exception:  # noqa: BLE001
            logs.get("serve").exception("MLflow report failed")


def end_silent_runs(client, experiment_id: str, tags: dict, stale_s: float, by: str) -> list[str]:
    """End as KILLED the RUNNING serving runs of the same app and deployment whose last heartbeat is older than
    `stale_s`: their replicas died without ending them (a killed process, a lost node). -> their run ids."""
    filters = " and ".join(["attributes.status = 'RUNNING'"] + [
        f"tags.{key} = '{tags[key]}'" for key in ("app", "deployment") if key in tags])
    now, ended = time.time(), []
    for run in client.search_runs([experiment_id], filters, max_results=1000):
        beat = float(run.data.tags.get(HEARTBEAT, run.info.start_time / 1000))
        if now - beat > stale_s:
            client.set_tag(run.info.run_id, ENDED, f"no heartbeat for {now - beat:.0f} s; ended by {by}")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    return ended
