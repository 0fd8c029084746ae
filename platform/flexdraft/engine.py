"""The FlexDraft decoding engine (DESIGN.md section 5): lossless speculative decoding with a drafter that
drafts over the target's own KV cache, in sequential or parallel mode, with continuous batching.

Shapes: n = active rows (rows 0..n-1 of every buffer and of the cache), Bv = drafts verified this step
(<= the drafter's block size), T = Bv + 1 verify tokens per row, m = branches kept per row (parallel mode),
V = vocabulary, d = model width.

Per row the engine holds `lens` (tokens in the cache), `bonus` (the last emitted token, not yet in the cache:
it sits at position lens) and, when `has_drafts`, the drafts d_1..d_B for positions lens+1.. with their
confidences (and their full distributions q for sampled rows). One step:
  1. admit waiting requests: prefill, draw the first token (it becomes the row's bonus);
  2. AR mode: one target token per row. Speculative modes: rows without drafts (fresh, pruned, or coming
     from an AR step) get a sequential drafter pass with the bonus known in slot 0; then the target verifies
     [bonus, d_1..d_Bv] per row. Sequential mode drafts again next step; parallel mode carries candidate
     draft blocks (branches) through the same verify forward and keeps the one matching the accepted length;
  3. finished rows leave (the last row moves into the freed one: rows stay contiguous).
Lossless: every emitted token is the target's argmax (greedy) or drawn by speculative sampling against
the target's distribution; the drafts only decide how many of them one forward yields.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flexdraft.drafter import Drafter
from flexdraft.errors import FlexDraftError
from flexdraft.generate import Generation, SamplingParams, filtered_logits, make_generator, prefill
from flexdraft.models.transformer import Transformer, grouped_bias

MODES = ("ar", "sequential", "parallel", "adaptive")


@dataclass
class EngineConfig:
    mode: str = "adaptive"  # ar | sequential | parallel | adaptive
    block_size: int = 0  # drafts verified per step; 0 = the drafter's block size (at most that)
    switch_batch: int = 4  # S: adaptive runs parallel mode at <= S active rows, sequential above
    top_m: int = 0  # parallel: keep at most the m most probable branches per row; 0 = no cap
    rho: float = 1.0  # parallel: keep the most probable branches until they cover this mass; 1 = all
    calibrate: bool = True  # parallel: correct the taken branch with the now-known bonus
    cost_model: bool = True  # adaptive: per step, pick AR / sequential / parallel and Bv by measured cost
    max_batch: int = 16  # rows decoded together; further requests wait
    max_len: int = 2048  # cache slots per row: prompt + max_new_tokens + block_size + 1 must fit

    def check(self, drafter: Drafter | None, context: int) -> None:
        if self.mode not in MODES:
            raise FlexDraftError(f"engine mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode != "ar" and drafter is None:
            raise FlexDraftError(f"mode {self.mode} needs a drafter (mode ar does not)")
        if drafter is not None and not 0 <= self.block_size <= drafter.config.block_size:
            raise FlexDraftError(f"block_size={self.block_size} must be between 1 and the drafter's block size "
                                 f"{drafter.config.block_size} (0 = the drafter's)")
        if self.top_m < 0:
            raise FlexDraftError(f"top_m must be >= 0 (0 = no cap), got {self.top_m}")
        if not 0 < self.rho <= 1:
            raise FlexDraftError(f"rho must be in (0, 1], got {self.rho}")
        if self.switch_batch < 0:
            raise FlexDraftError(f"switch_batch must be >= 0, got {self.switch_batch}")
        if self.max_batch < 1:
            raise FlexDraftError(f"max_batch must be >= 1, got {self.max_batch}")
        if not 2 <= self.max_len <= context:
            raise FlexDraftError(f"max_len={self.max_len} must be between 2 and the model's context of {context}")


@dataclass
class StepStats:
    mode: str  # ar | sequential | parallel | idle
    rows: int  # rows decoded this step (after admission)
    admitted: int = 0
    block: int = 0  # drafts verified per row
    drafted_rows: int = 0  # rows that needed a sequential drafter pass
    branches: float = 0.0  # parallel: branches kept per row (mean)
    pruned_misses: int = 0  # parallel: rows whose real accepted length fell on a pruned branch
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verified row
    seconds: float = 0.0
    forward_seconds: dict = field(default_factory=dict)  # prefill / draft / verify


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per speculative step
    forwards: int = 0  # target forwards after the prefill (AR or verify steps)
    finish_reason: str | None = None


class AcceptanceModel:
    """Running estimate of P(draft j accepted | drafts 1..j-1 accepted) for sequential (bonus known) and
    parallel (masked slot 0) drafts, started from the drafter's validation numbers when it has them."""

    def __init__(self, block: int, prior: dict | None = None, weight: float = 20.0):
        self.tried = {k: torch.full((block,), weight, dtype=torch.float64) for k in ("sequential", "parallel")}
        self.passed = {k: torch.zeros(block, dtype=torch.float64) for k in ("sequential", "parallel")}
        for kind, key in (("sequential", "bonus"), ("parallel", "mask_calibrated")):
            acc = [(prior or {}).get(f"eval/{key}/acc_slot{j + 1}") for j in range(block)]
            # acc_slotj is P(slot j agrees); without a prior assume a weak drafter: 0.5, 0.25, ...
            for j in range(block):
                p = acc[j] if acc[j] is not None else 0.5 ** (j + 1)
                cond = p / max(acc[j - 1] if j and acc[j - 1] else 1.0, 1e-6) if acc[j] is not None else 0.5
                self.passed[kind][j] = weight * min(max(cond, 0.0), 1.0)

    def record(self, kind: str, block: int, accepted: list[int]) -> None:
        for a in accepted:
            n = min(a + 1, block)  # drafts 1..a passed, draft a+1 (if any) failed
            self.tried[kind][:n] += 1
            self.passed[kind][:a] += 1

    def expected_accepted(self, kind: str, block: int) -> float:
        rate = self.passed[kind][:block] / self.tried[kind][:block]
        return float(rate.cumprod(0).sum())


class CostModel:
    """Seconds of a forward as a function of the token-layers it computes (rows x tokens x layers / L),
    interpolated from the forwards the engine has timed: after a few steps in a mode at a batch size the
    adaptive policy knows what each option costs here, on this device."""

    def __init__(self):
        self.points: dict[int, float] = {}  # log2-bucketed token count -> EMA seconds

    @staticmethod
    def _bucket(tokens: float) -> int:
        return max(0, round(2 * torch.log2(torch.tensor(max(tokens, 1.0))).item()))

    def record(self, tokens: float, seconds: float) -> None:
        b = self._bucket(tokens)
        self.points[b] = seconds if b not in self.points else 0.8 * self.points[b] + 0.2 * seconds

    def known(self, tokens: float) -> bool:
        return self._bucket(tokens) in self.points

    def seconds(self, tokens: float) -> float:
        b = self._bucket(tokens)
        if b in self.points:
            return self.points[b]
        lo = [k for k in self.points if k < b]
        hi = [k for k in self.points if k > b]
        if lo and hi:  # linear in the bucket index between the nearest measured ones
            l, h = max(lo), min(hi)
            return self.points[l] + (self.points[h] - self.points[l]) * (b - l) / (h - l)
        if lo:  # above every measured size: time grows at most linearly with tokens
            l = max(lo)
            return self.points[l] * 2 ** ((b - l) / 2)
        return self.points[min(hi)] if hi else 0.0


class Engine:
    """Continuous-batching speculative decoder over preallocated buffers.

    `add_request(prompt_ids, params) -> id`, `step() -> {id: new token ids}`, `abort(id)`; `generate` is a
    thin loop over them. Requests beyond `max_batch` wait and are admitted as rows finish."""

    def __init__(self, target: Transformer, drafter: Drafter | None, config: EngineConfig, eos_token_ids=(),
                 acceptance_prior: dict | None = None):
        config.check(drafter, target.args.max_position_embeddings)
        self.target, self.drafter, self.config = target, drafter, config
        self.B = (config.block_size or drafter.config.block_size) if drafter is not None else 0
        self.eos = set(eos_token_ids)
        R, dev = config.max_batch, target.device
        self.cache = target.new_cache(R, config.max_len)
        self.bonus = torch.zeros(R, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(R, max(self.B, 1), dtype=torch.long, device=dev)
        self.conf = torch.zeros(R, max(self.B, 1), dtype=torch.float32, device=dev)  # q_j(d_j)
        self.has_drafts = torch.zeros(R, dtype=torch.bool, device=dev)
        self.q: torch.Tensor | None = None  # [R, B, V] fp32 draft distributions, allocated for sampling
        self.slots: list[_Request] = []  # request of cache row r
        self.waiting: deque[_Request] = deque()
        self.finished: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.acceptance = AcceptanceModel(max(self.B, 1), acceptance_prior)
        self.costs = CostModel()
        self.last_stats = StepStats("idle", 0)
        self.totals = {"steps": 0, "tokens": 0, "target_forwards": 0, "pruned_misses": 0, "parallel_rows": 0}

    # ---------------------------------------------------------------- requests

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise FlexDraftError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        V = self.target.args.vocab_size
        if not prompt:
            raise FlexDraftError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise FlexDraftError(f"prompt has token id {bad[0]} outside the vocabulary of {V}")
        need = len(prompt) + params.max_new_tokens + self.B + 1
        if need > self.config.max_len:
            raise FlexDraftError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} + "
                                 f"{self.B + 1} verify slots = {need} exceeds the cache of {self.config.max_len} "
                                 "slots per row (engine max_len)")
        req = _Request(next(self._ids), prompt, params, make_generator(params, self.target.device))
        if not params.greedy and self.q is None and self.B:
            self.q = torch.zeros(self.config.max_batch, self.B, V, device=self.target.device)
        self.waiting.append(req)
        return req.id

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request; the other rows are untouched."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                self.finished[req.id] = req
                return
        for row, req in enumerate(self.slots):
            if req.id == request_id:
                req.finish_reason = "abort"
                self._retire()
                return
        raise FlexDraftError(f"no running or waiting request with id {request_id}")

    def result(self, request_id: int) -> Generation:
        """The finished request's generation (and forget it)."""
        if request_id not in self.finished:
            raise FlexDraftError(f"request {request_id} is not finished (or unknown)")
        req = self.finished.pop(request_id)
        # tokens per target forward; the prefill's token is not counted (it costs the same in every mode)
        tau = (len(req.tokens) - 1) / req.forwards if req.forwards else 1.0
        return Generation(req.tokens, req.finish_reason, 0.0, len(req.prompt),
                          {"accepted_lengths": req.accepted, "tau": tau})

    @property
    def active(self) -> int:
        return len(self.slots)

    def has_work(self) -> bool:
        return bool(self.slots or self.waiting)

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> dict[int, list[int]]:
        """One decoding step for every active row (after admitting waiting requests): {id: new token ids}."""
        t0 = time.perf_counter()
        out: dict[int, list[int]] = {}
        stats = StepStats("idle", 0)
        stats.admitted = self._admit(out, stats)
        self._retire()
        n = len(self.slots)
        if n:
            mode, Bv = self._choose(n)
            stats.mode, stats.rows, stats.block = mode, n, Bv
            if mode != "ar":
                need = (~self.has_drafts[:n]).nonzero().squeeze(-1)
                if need.numel():
                    stats.drafted_rows = need.numel()
                    self._draft(need, Bv, stats)
            self._verify(n, Bv, mode, out, stats)
            self._retire()
        self._sync()
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        self.totals["steps"] += 1
        self.totals["tokens"] += sum(len(v) for v in out.values())
        return out

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    def _timed(self, stats: StepStats, name: str, tokens: float, fn):
        self._sync()
        t0 = time.perf_counter()
        result = fn()
        self._sync()
        dt = time.perf_counter() - t0
        stats.forward_seconds[name] = stats.forward_seconds.get(name, 0.0) + dt
        if name != "prefill":
            self.costs.record(tokens, dt)
        return result

    def _choose(self, n: int) -> tuple[str, int]:
        """Mode and drafts per row for a step with n rows."""
        cfg, B = self.config, self.B
        if cfg.mode != "adaptive":
            return cfg.mode, (0 if cfg.mode == "ar" else B)
        rule = "parallel" if n <= cfg.switch_batch else "sequential"
        if not cfg.cost_model:
            return rule, B
        # expected tokens per second of each option, from the acceptance model and the measured cost of
        # the forwards it needs (in token-layers: block tokens run through layers e..L-1 only); an option
        # whose forwards were never timed at this size is tried once first
        frac = 1 - self.drafter.config.entry_layer / self.target.args.n_layers
        options = [("ar", 0, n, [n])]
        for Bv in sorted({1, 2, 4, B} & set(range(1, B + 1))):
            tokens = n * (1 + self.acceptance.expected_accepted("sequential", Bv))
            options.append(("sequential", Bv, tokens, [n * (Bv + 1), n * (Bv + 1) * frac]))
        if rule == "parallel":
            m = min(cfg.top_m or B + 1, B + 1)
            tokens = n * (1 + self.acceptance.expected_accepted("parallel", B))
            options.append(("parallel", B, tokens, [n * (B + 1) * (1 + m * frac)]))
        best, best_rate = ("ar", 0), -1.0
        for mode, Bv, tokens, work in options:
            if not all(self.costs.known(w) for w in work):
                return mode, Bv
            rate = tokens / sum(self.costs.seconds(w) for w in work)
            if rate > best_rate:
                best, best_rate = (mode, Bv), rate
        return best

    def _admit(self, out, stats) -> int:
        """Prefill waiting requests into free rows (longest first) and emit their first token."""
        free = self.config.max_batch - len(self.slots)
        if not free or not self.waiting:
            return 0
        new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        new.sort(key=lambda r: -len(r.prompt))
        n0 = len(self.slots)
        rows = torch.arange(n0, n0 + len(new), device=self.target.device)
        view = self.cache.rows(n0, n0 + len(new))
        h = self._timed(stats, "prefill", 0, lambda: prefill(self.target, view, [r.prompt for r in new]))
        self.slots.extend(new)
        first = self._sample(self.target.logits(h), rows)  # [k]
        self.bonus[rows] = first
        self.has_drafts[rows] = False
        for r, tok in zip(range(n0, n0 + len(new)), first.tolist()):
            self._emit(r, [tok], out)
        return len(new)

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [r, V] of rows -> [r] tokens drawn with each row's own params and generator."""
        tokens = logits.float().argmax(-1)
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if not req.params.greedy:
                probs = filtered_logits(logits[i : i + 1], req.params).softmax(-1)
                tokens[i] = torch.multinomial(probs, 1, generator=req.generator)[0, 0]
        return tokens

    def _emit(self, row: int, tokens: list[int], out) -> None:
        """Append tokens to the row's request, cut at EOS or max_new_tokens."""
        req = self.slots[row]
        room = req.params.max_new_tokens - len(req.tokens)
        emitted = []
        for t in tokens[:room]:
            emitted.append(t)
            if t in self.eos:
                req.finish_reason = "eos"
                break
        req.tokens.extend(emitted)
        if req.finish_reason is None and len(req.tokens) >= req.params.max_new_tokens:
            req.finish_reason = "length"
        out.setdefault(req.id, []).extend(emitted)

    def _set_drafts(self, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Draft logits [r, Bv, V] of rows -> drafts (argmax, or drawn from q for sampled rows) + confidences."""
        Bv = logits.shape[1]
        probs = logits.float().softmax(-1)
        conf, drafts = probs.max(-1)  # [r, Bv]
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if not req.params.greedy:
                q = filtered_logits(logits[i], req.params).softmax(-1)  # [Bv, V]
                drafts[i] = torch.multinomial(q, 1, generator=req.generator).squeeze(-1)
                conf[i] = q.gather(-1, drafts[i][:, None]).squeeze(-1)
                self.q[row, :Bv] = q
        self.drafts[rows, :Bv] = drafts
        self.conf[rows, :Bv] = conf
        self.conf[rows, Bv:] = 0.0
        self.has_drafts[rows] = True

    def _draft(self, rows: torch.Tensor, Bv: int, stats: StepStats) -> None:
        """Sequential drafter pass for `rows`: slot 0 = their known bonus, slots 1..Bv draft."""
        dev, T = self.target.device, Bv + 1
        lens = self.cache.lens[rows]  # [r]
        pos = lens[:, None] + torch.arange(T, device=dev)  # [r, T]: slot 0 at the bonus' position
        inputs = self.drafter.slot_inputs(self.target, self.bonus[rows], torch.ones_like(rows, dtype=torch.bool))
        S = int(lens.max())
        ctx = (torch.arange(S, device=dev) < lens[:, None, None]).expand(-1, T, S)  # [r, T, S]
        block_of = torch.zeros_like(pos)
        frac = (self.target.args.n_layers - self.drafter.config.entry_layer) / self.target.args.n_layers

        def run():
            h = self.drafter(self.target, inputs[:, :T], pos, block_of, self.cache, ctx, rows=rows)
            return self.target.logits(h[:, 1:])  # [r, Bv, V]

        self._set_drafts(rows, self._timed(stats, "draft", rows.numel() * T * frac, run))

    def _verify(self, n: int, Bv: int, mode: str, out, stats: StepStats) -> None:
        """Target forward over [bonus, d_1..d_Bv] of rows 0..n-1 (+ branches in parallel mode), acceptance,
        emission, cache rollback by length."""
        dev, T = self.target.device, Bv + 1
        rows = torch.arange(n, device=dev)
        tokens = torch.cat((self.bonus[:n, None], self.drafts[:n, :Bv]), dim=1)  # [n, T]
        lens = self.cache.lens[:n].clone()
        pos = lens[:, None] + torch.arange(T, device=dev)
        view = self.cache.rows(0, n)
        if mode == "parallel":
            anchors = self._branches(n, Bv, stats)  # [n, m]
            work = n * T + anchors.numel() * T * (self.target.args.n_layers - self.drafter.config.entry_layer) \
                / self.target.args.n_layers
            h, hb = self._timed(stats, "verify", work,
                                lambda: parallel_forward(self.target, self.drafter, tokens, pos, view, anchors))
        else:
            h = self._timed(stats, "verify", n * T, lambda: self.target(tokens, pos, view))
            hb = None
        self.totals["target_forwards"] += 1
        logits = self.target.logits(h)  # [n, T, V]
        accepted, new_bonus = self._accept(logits, tokens[:, 1:], rows)  # [n], [n]
        self.cache.lens[:n] = lens + accepted + 1
        self.bonus[:n] = new_bonus
        self.has_drafts[:n] = False
        acc = accepted.tolist()
        if mode != "ar":
            stats.accepted = acc
            self.acceptance.record(mode, Bv, acc)
        drafts, bonus = self.drafts[:n, :Bv].tolist(), new_bonus.tolist()
        for r in range(n):
            self.slots[r].forwards += 1
            if mode != "ar":
                self.slots[r].accepted.append(acc[r])
            self._emit(r, drafts[r][: acc[r]] + [bonus[r]], out)
        if hb is not None:
            self._take_branches(hb, anchors, accepted, new_bonus, Bv, stats)

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor):
        """logits [n, T, V] at the verify tokens, drafts [n, Bv] -> accepted drafts [n], next bonus [n].

        Greedy: accept while d_j equals the target's argmax; the bonus is the argmax after the last accepted.
        Sampling: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the
        bonus from normalize(max(0, p_j - q_j)), after all accepted from p_Bv (speculative sampling)."""
        n, Bv = drafts.shape
        top = logits.float().argmax(-1)  # [n, T]
        match = (drafts == top[:, :Bv]).long()
        accepted = match.cumprod(-1).sum(-1) if Bv else torch.zeros(n, dtype=torch.long, device=logits.device)
        bonus = top.gather(1, accepted[:, None]).squeeze(1)
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if req.params.greedy:
                continue
            p = filtered_logits(logits[i], req.params).softmax(-1)  # [T, V]
            a = 0
            while a < Bv:
                d = drafts[i, a]
                ratio = p[a, d] / self.q[row, a, d]
                if torch.rand((), generator=req.generator, device=p.device) >= ratio:
                    break
                a += 1
            if a < Bv:
                residual = (p[a] - self.q[row, a]).clamp_(min=0)
                dist = residual if residual.sum() > 0 else p[a]
            else:
                dist = p[a]
            accepted[i] = a
            bonus[i] = torch.multinomial(dist / dist.sum(), 1, generator=req.generator)[0]
        return accepted, bonus

    def _branches(self, n: int, Bv: int, stats: StepStats) -> torch.Tensor:
        """Selective verification: per row, the accepted lengths a (branch anchors) most probable under
        P(accept >= a) = prod_{j<=a} c_j and P(accept = a) = P(>= a) (1 - c_{a+1}) -> [n, m], most probable first."""
        c = self.conf[:n, :Bv].double()
        ge = torch.cat((torch.ones(n, 1, dtype=c.dtype, device=c.device), c.cumprod(-1)), dim=1)  # [n, Bv+1]
        eq = ge * (1 - torch.cat((c, torch.zeros_like(c[:, :1])), dim=1))
        m = Bv + 1
        if self.config.rho < 1:
            mass = eq.sort(-1, descending=True).values.cumsum(-1)
            m = int((mass < self.config.rho * eq.sum(-1, keepdim=True)).sum(-1).max()) + 1
        if self.config.top_m:
            m = min(m, self.config.top_m)
        stats.branches = float(min(m, Bv + 1))
        return eq.topk(min(m, Bv + 1), dim=-1).indices

    def _take_branches(self, hb, anchors, accepted, new_bonus, Bv, stats) -> None:
        """hb [n, m, Bv+1, d]: the branch whose anchor equals the accepted length becomes the row's drafts
        (calibrated with the bonus); rows whose branch was pruned draft sequentially next step."""
        n = anchors.shape[0]
        hit = anchors == accepted[:, None]  # [n, m]
        rows = hit.any(-1).nonzero().squeeze(-1)
        misses = n - rows.numel()
        stats.pruned_misses = misses
        self.totals["pruned_misses"] += misses
        self.totals["parallel_rows"] += n
        if not rows.numel():
            return
        branch = hit[rows].float().argmax(-1)
        h = hb[rows, branch, 1:]  # [r, Bv, d]
        if self.config.calibrate:
            h = self.drafter.calibrate(self.target, h, new_bonus[rows, None].expand(-1, Bv))
        self._set_drafts(rows, self.target.logits(h))

    def _retire(self) -> None:
        """Remove finished rows; the last row moves into each freed row (a copy of its cached prefix)."""
        r = 0
        while r < len(self.slots):
            req = self.slots[r]
            if req.finish_reason is None:
                r += 1
                continue
            self.finished[req.id] = req
            last = len(self.slots) - 1
            if r != last:
                n = int(self.cache.lens[last])
                for k in (*self.cache.k, *self.cache.v):
                    k[r, :, :n] = k[last, :, :n]
                for buf in (self.cache.lens, self.bonus, self.drafts, self.conf, self.has_drafts):
                    buf[r] = buf[last]
                if self.q is not None:
                    self.q[r] = self.q[last]
                self.slots[r] = self.slots[last]
            self.slots.pop()

    # ---------------------------------------------------------------- convenience

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """All prompts through the continuous-batching loop; results in input order."""
        t0 = time.perf_counter()
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        seconds = (time.perf_counter() - t0) / max(len(prompts), 1)
        results = [self.result(i) for i in ids]
        for g in results:
            g.seconds = seconds
        return results


def parallel_forward(target: Transformer, drafter: Drafter, tokens: torch.Tensor, pos: torch.Tensor, cache,
                     anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over verify tokens [n, T] that also carries, from the drafter's entry layer on, a
    masked draft block per branch: branch anchors [n, m] (a = accepted drafts it assumes) -> clean hidden
    states [n, T, d] and branch hidden states [n, m, T, d].

    The clean path runs exactly the ops of `target(tokens, pos, cache)` (same shapes, same order): its
    outputs are bitwise those of a plain verify. Branch a sits at positions pos[:, a] + 1 .. + T and sees
    the cached prefix plus verify tokens 0..a (written into the cache by this layer's clean path before
    the branches read it) and its own block; slot 0 is the mask (the bonus is not known yet)."""
    n, T = tokens.shape
    m = anchors.shape[1]
    dev = tokens.device
    span = int(pos.max()) + 1
    mask = (torch.arange(span, device=dev) <= pos[..., None])[:, None]  # as Transformer.forward builds it
    if target.math_attention:
        mask = grouped_bias(mask, target.args.n_heads // target.args.n_kv_heads)
    base = pos[:, :1] + anchors  # [n, m]: position of verify token a (the branch's last visible one)
    bpos = (base[:, :, None] + 1 + torch.arange(T, device=dev)).reshape(n, m * T)  # [n, m*T]
    block_of = torch.arange(m, device=dev).repeat_interleave(T).expand(n, -1)
    ctx = torch.arange(span, device=dev) <= base.repeat_interleave(T, dim=1)[:, :, None]  # [n, m*T, span]
    bmasks = drafter.block_masks(target, bpos, block_of, ctx)
    bcos, bsin = target.rope(bpos, target.dtype)
    x = target.embed_tokens(tokens)
    cos, sin = target.rope(pos, x.dtype)
    xb = drafter.mask_embedding.to(x.dtype).expand(n, m * T, -1)
    for i, layer in enumerate(target.layers):
        x = layer(x, cos, sin, mask, cache, i, pos, span)
        if i >= drafter.config.entry_layer:
            xb = drafter.block_layer(target, i, xb, bcos, bsin, cache.k[i][:, :, :span], cache.v[i][:, :, :span],
                                     bmasks)
    return target.norm(x), target.norm(xb).view(n, m, T, -1)
