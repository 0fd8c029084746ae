"""The replica's Prometheus metrics (Ray Serve custom metrics), named as vLLM's spec-decode and request metrics."""
from __future__ import annotations

import time

from flexdraft.engine.stats import SpecDecodingStats, StepOutput


class Metrics:
    """Ray Serve custom metrics (exported to Prometheus by Ray) named as vLLM's spec-decode and request metrics."""

    LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]

    def __init__(self):
        from ray.serve import metrics as m

        self.drafts = m.Counter("flexdraft_spec_decode_num_drafts", "Draft blocks verified (rows x speculative steps)")
        self.draft_tokens = m.Counter("flexdraft_spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = m.Counter("flexdraft_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.per_pos = m.Counter("flexdraft_spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted at each draft position", tag_keys=("position",))
        self.steps = m.Counter("flexdraft_steps", "Engine steps by decoding mode", tag_keys=("mode",))
        self.batch = m.Gauge("flexdraft_batch_size", "Rows decoded in the latest step")
        self.running = m.Gauge("flexdraft_num_requests_running", "Requests decoding")
        self.waiting = m.Gauge("flexdraft_num_requests_waiting", "Requests waiting for a row")
        self.preemptions = m.Counter("flexdraft_num_preemptions", "Rows given up to a client that held none")
        self.streams = m.Gauge("flexdraft_num_streams", "Callers waiting for tokens (0 when idle: none leaked)")
        self.source = None  # the AsyncEngine whose streams are counted
        self.generated = m.Counter("flexdraft_generation_tokens", "Tokens generated")
        self.ttft = m.Histogram("flexdraft_time_to_first_token_seconds", "Time to first token",
                                boundaries=self.LATENCY_BUCKETS)
        self.tpot = m.Histogram("flexdraft_time_per_output_token_seconds", "Time per output token after the first",
                                boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2])
        self.e2e = m.Histogram("flexdraft_e2e_request_latency_seconds", "End-to-end request latency",
                               boundaries=self.LATENCY_BUCKETS)

    def on_step(self, out: StepOutput) -> None:
        """Engine thread, after every step."""
        stats = out.stats
        self.steps.inc(tags={"mode": stats.kind})
        self.batch.set(stats.rows)
        self.running.set(len(out.running))
        self.waiting.set(len(out.waiting))
        if stats.preempted:
            self.preemptions.inc(stats.preempted)
        if self.source is not None:
            self.streams.set(self.source.load()["streams"])
        counts = SpecDecodingStats.of_step(stats)
        if counts.num_drafts:  # (a Ray counter refuses inc(0): a step whose drafts were all rejected accepts 0)
            self.drafts.inc(counts.num_drafts)
            self.draft_tokens.inc(counts.num_draft_tokens)
            if counts.num_accepted_tokens:
                self.accepted.inc(counts.num_accepted_tokens)
            for pos, n in enumerate(counts.num_accepted_tokens_per_pos):
                self.per_pos.inc(n, tags={"position": str(pos)})

    def request_done(self, t0: float, t_first: float | None, tokens: int) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - t0)
        self.generated.inc(tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if tokens > 1:
                self.tpot.observe((now - t_first) / (tokens - 1))
