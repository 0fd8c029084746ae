"""The FlexDraft decoding engine (docs/design.md): lossless speculative decoding with a drafter that
drafts over the target's own KV cache, in sequential or parallel mode, with continuous batching.

Shapes: n = active rows (rows 0..n-1 of every buffer and of the cache), Bv = drafts verified this step
(<= the drafter's block size), T = Bv + 1 verify tokens per row, m = branches kept per row (parallel mode),
V = vocabulary, d = model width.

Per row the engine holds `lens` (tokens in the cache), `bonus` (the last emitted token, not yet in the cache:
it sits at position lens) and `ndrafts` drafts d_1.. for positions lens+1.. with their confidences (and
their full distributions q for sampled rows); `from_branch` says whether a parallel branch made them. One step:
  1. admit waiting requests: prefill, draw the first token (it becomes the row's bonus);
  2. AR mode: one target token per row. Speculative modes: rows without drafts (fresh, pruned, or coming
     from an AR step) get a sequential drafter pass with the bonus known in slot 0; then the target verifies
     [bonus, d_1..d_Bv] per row. Sequential mode drafts again next step; tree mode verifies a
     token tree built from each slot's top candidates instead of the chain d_1..d_Bv; parallel mode carries
     candidate draft blocks (branches) through the same verify forward and keeps the one matching the
     accepted length. A lookup step verifies prompt-lookup drafts instead (the tokens that followed the
     latest earlier occurrence of the row's last n tokens, `lookup.NgramIndex`) and, with an n-gram store
     (`lookup.NgramStore`), the store's chain too, both as one token trie; it runs no drafter;
  3. finished rows leave (the last row moves into the freed one: rows stay contiguous).
Lossless: every emitted token is the target's argmax (greedy) or drawn by speculative sampling against
the target's distribution; the drafts only decide how many of them one forward yields.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flexdraft.drafter.model import Drafter, parallel_forward
from flexdraft.engine.config import NO_DRAFTER, EngineConfig, StepStats
from flexdraft.core.errors import FlexDraftError
from flexdraft.speculative.sampling import Generation, SamplingParams, argmax_tokens, draw, filtered_logits, make_generator, sample, top_logprobs
from flexdraft.engine.ar import prefill
from flexdraft.speculative.lookup import NgramIndex, NgramStore
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.policy_file import Band, Policy
from flexdraft.speculative.planner import LOOKUP_MARGIN, Planner, measure, profile_shapes
from flexdraft.speculative.branches import Plan, branch_anchors
from flexdraft.speculative.trees import chain_trie, draft_tree, tree_ancestors, tree_sample, tree_tokens, tree_walk
from flexdraft.speculative.verify import greedy_accept, speculative_sample

@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per speculative step
    forwards: int = 0  # target forwards after the prefill (AR or verify steps)
    modes: dict = field(default_factory=dict)  # those forwards by step mode
    finish_reason: str | None = None
    index: NgramIndex | None = None  # its prompt and tokens, for lookup drafts


@dataclass
class RowState:
    """What each cache row holds beside its cached tokens (row r of every tensor = cache row r); `move` covers
    every field, so a new one cannot be forgotten when a finished row is filled."""
    bonus: torch.Tensor  # [R] the last emitted token, not yet in the cache (it sits at position lens)
    drafts: torch.Tensor  # [R, B] d_1.. for positions lens+1..
    conf: torch.Tensor  # [R, B] fp32 q_j(d_j)
    ndrafts: torch.Tensor  # [R] valid drafts per row (0: draft first)
    from_branch: torch.Tensor  # [R] bool: a parallel branch made the drafts
    cand: torch.Tensor  # [R, B, K] each draft slot's top-K candidates (token trees)
    cand_logp: torch.Tensor  # [R, B, K] fp32, their log-probabilities
    q: torch.Tensor | None = None  # [R, B, V] fp32 draft distributions, allocated for the first sampled request

    @staticmethod
    def empty(rows: int, block: int, tree_width: int, device) -> "RowState":
        zeros = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)
        return RowState(bonus=zeros(rows), drafts=zeros(rows, block), conf=zeros(rows, block, dtype=torch.float32),
                        ndrafts=zeros(rows), from_branch=zeros(rows, dtype=torch.bool),
                        cand=zeros(rows, block, tree_width),
                        cand_logp=zeros(rows, block, tree_width, dtype=torch.float32))

    def move(self, src: int, dst: int) -> None:
        """Row src's state into row dst."""
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t[dst] = t[src]


class Engine:
    """Continuous-batching speculative decoder over preallocated buffers.

    `add_request(prompt_ids, params) -> id`, `step() -> {id: new token ids}`, `abort(id)`; `generate` is a
    thin loop over them. Requests beyond `max_batch` wait and are admitted as rows finish."""

    def __init__(self, target: Transformer, drafter: Drafter | None, config: EngineConfig, eos_token_ids=(),
                 acceptance_prior: dict | None = None, store: NgramStore | None = None, policy: Policy | None = None):
        """policy: the step settings per live batch size (`policy_file`); it sets the config's mode (adaptive), S,
        cost model and the largest block, tree and n-gram size its bands use. The caller checks it was measured
        for this target and drafter (`runner.resolve_policy`)."""
        if policy is not None:
            for key, value in policy.engine_settings().items():
                setattr(config, key, value)
        config.check(drafter, target.args.max_position_embeddings)
        self.target, self.drafter, self.config, self.policy = target, drafter, config, policy
        if drafter is not None and drafter.paired is None:
            raise FlexDraftError("the drafter is not ready for inference: call drafter.to_runtime(target) first "
                                 "(runner.resolve_drafter does)")
        if drafter is not None:
            self.B = config.block_size or drafter.config.block_size
        else:
            self.B = (config.block_size or 8) if config.mode == "lookup" else 0
        # n-gram size of prompt-lookup drafts (0: none); adaptive weighs them by cost only
        weighed = config.mode == "lookup" or (config.mode == "adaptive" and (config.cost_model or policy is not None))
        self.lookup = config.lookup if weighed else 0
        self.store = store if self.lookup else None  # a corpus's drafts beside the request's own (lookup steps)
        self._proposals: list[tuple[list[list[int]], str | None]] = []  # this step's lookup chains per row, kind
        self.eos = set(eos_token_ids)
        R, dev = config.max_batch, target.device
        self.cache = target.new_cache(R, config.max_len)
        self.trees = bool(self.B and config.tree_nodes and config.mode in ("tree", "adaptive"))
        self.state = RowState.empty(R, max(self.B, 1), min(config.tree_width, target.args.vocab_size)
                                    if self.trees else 1, dev)
        self.slots: list[_Request] = []  # request of cache row r
        self.waiting: deque[_Request] = deque()
        self.admit_limit: int | None = None  # at most this many admissions a step (a server isolating a failure)
        self.finished: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.planner = Planner(self.B, config.switch_batch, config.tree_nodes, self.trees, config.cost_model,
                               acceptance_prior)
        self.acceptance, self.costs = self.planner.acceptance, self.planner.costs
        self.last_stats = StepStats("idle", 0)
        self.totals = {"steps": 0, "tokens": 0, "target_forwards": 0, "pruned_misses": 0, "parallel_rows": 0}

    # ---------------------------------------------------------------- requests

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise FlexDraftError naming what makes this request impossible (nothing is queued)."""
        if not isinstance(params, SamplingParams):
            raise FlexDraftError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        V = self.target.args.vocab_size
        if not prompt:
            raise FlexDraftError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise FlexDraftError(f"prompt has token id {bad[0]} outside the vocabulary of {V}")
        need = self.slots_needed(len(prompt), params.max_new_tokens)
        if need > self.config.max_len:
            raise FlexDraftError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} + "
                                 f"{need - len(prompt) - params.max_new_tokens} verify and branch slots = {need} "
                                 f"exceeds the cache of {self.config.max_len} slots per row (engine max_len)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.check_request(prompt, params)
        V = self.target.args.vocab_size
        req = _Request(next(self._ids), prompt, params, make_generator(params, self.target.device),
                       index=NgramIndex(prompt, self.lookup) if self.lookup else None)
        if not params.greedy and self.state.q is None and self.B:
            self.state.q = torch.zeros(self.config.max_batch, self.B, V, device=self.target.device)
        self.waiting.append(req)
        return req.id

    def slots_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots a request needs: its tokens, the verify block and, when parallel steps may run, the
        branch tokens' scratch past the verify block ((B+1)^2 at most), or a token tree's nodes."""
        branches = (self.B + 1) ** 2 if self.config.mode in ("parallel", "adaptive") else 0
        tree = max(self.config.tree_nodes + 1 if self.trees else 0, 2 * self.B + 1 if self.store else 0)
        return prompt_len + max_new_tokens + max(self.B + 1 + branches, tree)

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request; the other rows are untouched."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                self.finished[req.id] = req
                return
        for req in self.slots:
            if req.id == request_id:
                req.finish_reason = "abort"
                self._retire()
                return
        raise FlexDraftError(f"no running or waiting request with id {request_id}")

    def result(self, request_id: int) -> Generation:
        """The finished (or aborted) request's generation; the engine forgets it (a server calls this once
        per request it added)."""
        if request_id not in self.finished:
            raise FlexDraftError(f"request {request_id} is not finished (or unknown)")
        req = self.finished.pop(request_id)
        # tokens per target forward; the prefill's token is not counted (it costs the same in every mode)
        tau = (len(req.tokens) - 1) / req.forwards if req.forwards else 1.0
        share = {mode: count / req.forwards for mode, count in req.modes.items()}
        return Generation(req.tokens, req.finish_reason, 0.0, len(req.prompt),
                          {"accepted_lengths": req.accepted, "tau": tau, "forwards": req.forwards, "mode_share": share})

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
        stats = self.last_stats = StepStats("idle", 0)  # this step's, filled as it goes
        out = self._admit()
        self._retire()
        n = len(self.slots)
        if n:
            plan = self._choose(n)
            stats.mode, stats.rows, stats.block = plan.mode, n, plan.block
            if plan.mode not in NO_DRAFTER:  # (lookup drafts: set by _verify, as a chain or a trie)
                need = (self.state.ndrafts[:n] < plan.block).nonzero().squeeze(-1)
                if need.numel():
                    stats.drafted_rows = need.numel()
                    self._draft(need, plan.block)
            for rid, tokens in self._verify(n, plan).items():  # (a row admitted this step: after its first)
                out.setdefault(rid, []).extend(tokens)
            self._retire()
        self._sync()
        stats.seconds = time.perf_counter() - t0
        if n and not stats.admitted:
            self.costs.record_step(stats.mode, stats.seconds, sum(stats.forward_seconds.values()))
        self.totals["steps"] += 1
        self.totals["tokens"] += sum(len(v) for v in out.values())
        return out

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    def _timed(self, kind: str, fn, rows: int = 0, tokens: int = 0):
        """Run fn, add its wall time to this step's `last_stats` under `kind` and, for a forward of `rows` rows x
        `tokens` tokens each, to the cost model."""
        self._sync()
        t0 = time.perf_counter()
        result = fn()
        self._sync()
        dt = time.perf_counter() - t0
        seconds = self.last_stats.forward_seconds
        seconds[kind] = seconds.get(kind, 0.0) + dt
        if rows:
            self.costs.record(kind, rows, tokens, dt)
        return result

    def band(self, n: int) -> Band:
        """The step settings for n live rows: the policy's band, else the config's (read every step: a Serve
        replica changes top_m / rho live)."""
        if self.policy is not None:
            return self.policy.band(n)
        c = self.config
        return Band(None, c.mode, self.B, c.top_m, c.rho, c.tree_nodes if self.trees else 0, self.lookup)

    def tree_sizes(self) -> list[int]:
        """The token-tree sizes steps may verify (the cost profile measures each)."""
        if not self.trees:
            return []
        return sorted({b.tree_nodes for b in self.policy.bands} - {0}) if self.policy else [self.config.tree_nodes]

    def _choose(self, n: int) -> Plan:
        """The plan of a step with n rows, by their band: a fixed mode (lookup: AR when no row has a match), or
        adaptive: the planner's (`Planner.adaptive`), unless this step's lookup drafts promise more."""
        band = self.band(n)
        Bv = band.block or self.B
        if band.mode == "lookup":
            return Plan("lookup", Bv) if self._propose(n, band.lookup) else Plan("ar")
        if band.mode != "adaptive":
            return Plan(band.mode, 0 if band.mode == "ar" else Bv)
        fresh = int((self.state.ndrafts[:n] == 0).sum())
        plan, rate = self.planner.adaptive(n, fresh, self.totals["steps"], band)
        if band.lookup and rate is not None:  # against an AR step, a margin (see LOOKUP_MARGIN)
            return self._lookup_plan(n, band, rate * (LOOKUP_MARGIN if plan.mode == "ar" else 1.0)) or plan
        return plan

    def _propose(self, n: int, max_n: int, first: list[int] | None = None) -> bool:
        """This step's lookup chains of rows 0..n-1 from n-grams of up to max_n tokens (`_proposals`: per row its
        chains, the prompt's first, and the acceptance kind they count towards, None without any); True when some
        row has one. With `first`, rows that all need one: False as soon as one has none, the others not proposed
        (16 rows: ~1 ms a step)."""
        proposals: list = [None] * n
        for row in first or ():
            proposals[row] = self._proposal(self.slots[row], max_n)
            if proposals[row][1] is None:
                return False
        self._proposals = [p or self._proposal(req, max_n) for p, req in zip(proposals, self.slots[:n])]
        return any(kind for _, kind in self._proposals)

    def _proposal(self, req: _Request, max_n: int) -> tuple[list[list[int]], str | None]:
        chain, size = req.index.propose(self.B, max_n)
        chains, kind = ([chain], f"lookup{size}") if size else ([], None)
        if self.store is not None:
            extra, size = self.store.propose(req.index.tokens, self.B)
            if extra and extra != chain[:len(extra)]:  # a prefix of the prompt's chain adds nothing
                chains.append(extra)
                kind = kind or f"store{size}"
        return chains, kind

    def _critical_rows(self, n: int) -> list[int] | None:
        """The rows that set when this batch drains: None while requests wait (a row that finishes early is
        refilled, so every row's tokens count); else the rows with the most tokens left to their max_new_tokens
        (within B of the most). Drafts that speed up other rows end those rows early, not the batch: at 16 rows,
        lookup steps where 9-14 rows had a match made 2.6 tokens per row, yet the batch took 62 steps against
        AR's 63, each dearer (adaptive 0.92x of AR, the same prompts in lockstep)."""
        if self.waiting:
            return None
        left = [req.params.max_new_tokens - len(req.tokens) for req in self.slots[:n]]
        return [row for row, x in enumerate(left) if x >= max(left) - self.B]

    def _lookup_plan(self, n: int, band: Band, rate_to_beat: float) -> Plan | None:
        """A lookup step if one promises more than rate_to_beat tokens per second (`Planner.lookup`); it needs a
        match in every critical row (`_critical_rows`). With a store it also weighs the prompt's chains alone: a
        trie of two chains verifies up to twice the tokens, which at 4-16 rows costs more than the store's chains
        add (and `_proposals` becomes what won)."""
        critical = self._critical_rows(n)
        if not self._propose(n, band.lookup, first=critical):  # (a critical row without a match: n tokens, as AR, dearer)
            return None
        options = [self._proposals]
        if self.store is not None:
            options.append([(cs[:1], kind) if kind and kind.startswith("lookup") else ([], None)
                            for cs, kind in self._proposals])
        best = self.planner.lookup(options, critical, rate_to_beat, band.block or self.B)
        if best is None:
            return None
        plan, chosen = best
        self._proposals = options[chosen]
        return plan

    def _set_lookup_drafts(self, n: int, Bv: int) -> None:
        """Rows 0..n-1 get their (single) lookup chain, filled up to Bv with the row's bonus (a store chain can
        end early; a row without a match gets filler only), verified like any draft; sampled rows' q is the point
        mass on each draft (accepted with probability p(d_j))."""
        bonus = self.state.bonus[:n].tolist()
        chains = [((c[0] if c else []) + [b] * Bv)[:Bv] for (c, _), b in zip(self._proposals, bonus)]
        drafts = torch.tensor(chains, dtype=torch.long, device=self.state.drafts.device)  # [n, Bv]
        self.state.drafts[:n, :Bv] = drafts
        self.state.conf[:n, :Bv] = 1.0
        self.state.ndrafts[:n] = Bv
        self.state.from_branch[:n] = False
        for row in range(n):
            if not self.slots[row].params.greedy:
                self.state.q[row, :Bv] = torch.nn.functional.one_hot(drafts[row], self.state.q.shape[-1]).float()

    @torch.inference_mode()
    def profile(self, context: int = 256, rounds: int = 5, timer=None) -> dict:
        """Time each kind of forward over the shapes the planner prices (`planner.profile_shapes`; rows at
        `context` cached tokens) and seed the cost model with them (`planner.measure`); must run while no request
        is active. Returns {kind: {(rows, tokens per row): s}}. timer(kind, rows, tokens per row, branches) ->
        seconds of one forward (`_time_forward` by default)."""
        if self.slots:
            raise FlexDraftError("profile() needs an idle engine (no active rows)")
        if self.drafter is None:
            return {}
        B = self.B
        self.cache.lens.fill_(min(context, self.config.max_len - max((B + 1) * (B + 2), self.config.tree_nodes + 1)))
        self.state.bonus.fill_(0)
        self.state.drafts.fill_(0)
        shapes = profile_shapes(self.config.max_batch, B, self.config.switch_batch, self.tree_sizes())
        points = measure(shapes, timer or self._time_forward, rounds)
        self.costs.set_profile(points)
        self.cache.lens.zero_()
        self.last_stats = StepStats("idle", 0)
        return points

    def _time_forward(self, kind: str, n: int, T: int, m: int) -> float:
        """One forward of `kind` (target / draft / parallel with m branches) for rows 0..n-1, T tokens each, at
        the rows' cache lengths -> seconds."""
        dev = self.target.device
        rows = torch.arange(n, device=dev)
        pos = self.cache.lens[:n, None] + torch.arange(T, device=dev)
        tokens = torch.zeros(n, T, dtype=torch.long, device=dev)
        anchors = torch.arange(m, device=dev).expand(n, m)
        runs = {"target": lambda: self._target_logits(tokens, pos, self.cache.rows(0, n)),
                "draft": lambda: self._draft_forward(rows, T - 1),
                "parallel": lambda: self._parallel_logits(tokens, pos, self.cache.rows(0, n), anchors)}
        self.last_stats = StepStats("profile", n)
        self._timed(kind, runs[kind])
        return self.last_stats.forward_seconds[kind]

    def _admit(self) -> dict[int, list[int]]:
        """Prefill waiting requests into free rows (longest first) -> {id: [their next token]}. A request that
        comes back from `recover` prefills its prompt and the tokens it had made, and goes on from there."""
        free = self.config.max_batch - len(self.slots)
        if self.admit_limit is not None:
            free = min(free, self.admit_limit)
        if free <= 0 or not self.waiting:
            return {}
        new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        new.sort(key=lambda r: -(len(r.prompt) + len(r.tokens)))
        n0 = len(self.slots)
        self.slots.extend(new)  # rows first: a prefill that raises leaves them to `recover`, not lost
        self.last_stats.admitted, self.last_stats.admitted_ids = len(new), [r.id for r in new]
        rows = torch.arange(n0, n0 + len(new), device=self.target.device)
        view = self.cache.rows(n0, n0 + len(new))
        h = self._timed("prefill", lambda: prefill(self.target, view, [r.prompt + r.tokens for r in new]))
        first = self._sample(self.target.logits(h), rows)  # [k]
        self.state.bonus[rows] = first
        self.state.ndrafts[rows] = 0
        return {req.id: self._emit(r, [tok]) for r, req, tok in zip(range(n0, n0 + len(new)), new, first.tolist())}

    def recover(self) -> dict[int, list[int]]:
        """After a step that raised: every request in a row goes back to the front of the waiting queue (one that
        had finished, to `finished`) with the tokens it has made -> {id: those tokens} of these and of every
        finished request not yet collected (the failed step may have finished and retired it before raising,
        its last tokens undelivered). A re-queued request's next admission prefills prompt + tokens, so it goes on
        where it stood; the failed step's cache writes, drafts and plans are dropped. Greedy outputs are unchanged by this; sampled ones keep their generator's stream."""
        back = list(self.slots)
        self.slots.clear()
        self.cache.lens.zero_()
        self.state.ndrafts.zero_()
        self.planner.forget_plans()
        for req in reversed(back):
            if req.finish_reason is None:
                self.waiting.appendleft(req)
            else:
                self.finished[req.id] = req
        return {req.id: list(req.tokens) for req in (*back, *self.finished.values())}

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [r, V] of rows -> [r] tokens drawn with each row's own params and generator."""
        tokens = argmax_tokens(logits)
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if not req.params.greedy:
                tokens[i] = sample(logits[i : i + 1], req.params, req.generator)[0]
        return tokens

    def _emit(self, row: int, tokens: list[int]) -> list[int]:
        """Append tokens to the row's request, cut at EOS or max_new_tokens -> the tokens it kept."""
        req = self.slots[row]
        room = req.params.max_new_tokens - len(req.tokens)
        emitted = []
        for t in tokens[:room]:
            emitted.append(t)
            if t in self.eos:
                req.finish_reason = "eos"
                break
        req.tokens.extend(emitted)
        if req.index is not None:
            req.index.extend(emitted)
        if req.finish_reason is None and len(req.tokens) >= req.params.max_new_tokens:
            req.finish_reason = "length"
        return emitted

    def _set_drafts(self, rows: torch.Tensor, logits: torch.Tensor, from_branch: bool = False) -> None:
        """Draft logits [r, Bv, V] of rows -> drafts (argmax, or drawn from q for sampled rows) + confidences."""
        Bv = logits.shape[1]
        band = self.band(len(self.slots))
        if self.trees:  # a tree step may come next: keep each slot's top candidates (the first is the draft)
            logp, cand = top_logprobs(logits, self.state.cand.shape[-1])  # [r, Bv, K]
            self.state.cand[rows, :Bv], self.state.cand_logp[rows, :Bv] = cand, logp
            conf, drafts = logp[..., 0].exp(), cand[..., 0]
        elif band.mode == "parallel" or (band.mode == "adaptive" and len(self.slots) <= self.config.switch_batch):
            logp, drafts = top_logprobs(logits, 1)  # pruning weighs the confidences
            conf, drafts = logp[..., 0].exp(), drafts[..., 0]  # [r, Bv]
        else:  # no parallel step can come next at this batch size: skip the softmax over the vocabulary
            drafts = argmax_tokens(logits)
            conf = torch.ones(drafts.shape, device=drafts.device)
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if not req.params.greedy:
                q = filtered_logits(logits[i], req.params).softmax(-1)  # [Bv, V]
                drafts[i] = draw(q, req.generator)
                conf[i] = q.gather(-1, drafts[i][:, None]).squeeze(-1)
                self.state.q[row, :Bv] = q
        self.state.drafts[rows, :Bv] = drafts
        self.state.conf[rows, :Bv] = conf
        self.state.ndrafts[rows] = Bv
        self.state.from_branch[rows] = from_branch

    def _draft(self, rows: torch.Tensor, Bv: int) -> None:
        """Sequential drafter pass for `rows`: slot 0 = their known bonus, slots 1..Bv draft."""
        logits = self._timed("draft", lambda: self._draft_forward(rows, Bv), rows.numel(), Bv + 1)
        self._set_drafts(rows, logits)

    def _draft_forward(self, rows: torch.Tensor, Bv: int) -> torch.Tensor:
        """-> draft logits [r, Bv, V] of a block at each row's length (slot 0 = the bonus, at its position: its
        output, the target's own next token, is d_1)."""
        dev, T = self.target.device, Bv + 1
        inputs = self.drafter.slot_inputs(self.target, self.state.bonus[rows], torch.ones_like(rows, dtype=torch.bool))
        first = int(rows[0])
        if torch.equal(rows, torch.arange(first, first + rows.numel(), device=dev)):  # contiguous: no copies
            h = self.drafter.forward_in_cache(self.target, inputs[:, :T], self.cache.rows(first, first + rows.numel()))
        else:  # scattered rows (fresh or pruned ones among others): read their prefixes by index
            lens = self.cache.lens[rows]  # [r]
            pos = lens[:, None] + torch.arange(T, device=dev)  # [r, T]
            S = int(lens.max())
            ctx = (torch.arange(S, device=dev) < lens[:, None, None]).expand(-1, T, S)  # [r, T, S]: the prefix
            clean = (torch.arange(T, device=dev) == 0).expand(rows.numel(), T)  # slot 0: the known bonus
            h = self.drafter(self.target, inputs[:, :T], pos, torch.zeros_like(pos), self.cache, ctx, rows=rows,
                             clean=clean)
        return self.target.logits(h[:, self.drafter.draft_slots(Bv, bonus_known=True)])

    def _verify(self, n: int, plan: Plan) -> dict[int, list[int]]:
        """Target forward over [bonus, d_1..d_Bv] of rows 0..n-1 (+ branches in parallel mode), acceptance,
        cache rollback by length -> {id: emitted tokens}."""
        mode, Bv = plan.mode, plan.block
        if mode == "tree":
            depth, parent, rank = draft_tree(self.state.cand_logp[:n, :Bv], self.band(n).tree_nodes)  # [n, N]
            nodes = tree_tokens(self.state.cand[:n, :Bv], depth, rank)
            return self._verify_tree(n, Bv, depth, parent, nodes, ["tree"] * n)
        if mode == "lookup" and any(len(chains) > 1 for chains, _ in self._proposals):  # verified as a token trie
            chains = [[c[:Bv] for c in cs] for cs, _ in self._proposals]
            depth, parent, nodes = chain_trie(chains, self.state.bonus[:n].tolist(), self.target.device)
            return self._verify_tree(n, Bv, depth, parent, nodes, [k for _, k in self._proposals])
        if mode == "lookup":
            self._set_lookup_drafts(n, Bv)
        dev, T = self.target.device, Bv + 1
        rows = torch.arange(n, device=dev)
        tokens = torch.cat((self.state.bonus[:n, None], self.state.drafts[:n, :Bv]), dim=1)  # [n, T]
        lens = self.cache.lens[:n].clone()
        pos = lens[:, None] + torch.arange(T, device=dev)
        view = self.cache.rows(0, n)
        if mode == "parallel":
            anchors = self._branches(n, Bv, plan.branches)  # [n, m]
            logits, hb = self._timed("parallel", lambda: self._parallel_logits(tokens, pos, view, anchors),
                                     n, T * (1 + anchors.shape[1]))
        else:
            logits = self._timed("target", lambda: self._target_logits(tokens, pos, view), n, T)
            hb = None
        accepted, new_bonus = self._accept(logits, tokens[:, 1:], rows)  # [n], [n]
        if mode == "ar":
            kinds = None
        elif mode == "lookup":  # counted by n-gram size; rows without a match verified filler: not counted
            kinds = [kind for _, kind in self._proposals]
        else:
            kinds = ["parallel" if b else "sequential" for b in self.state.from_branch[:n].tolist()]
        out = self._commit(n, lens, accepted, new_bonus, self.state.drafts[:n, :Bv], kinds, Bv)
        if hb is not None:
            self._take_branches(hb, anchors, accepted, new_bonus, Bv)
        return out

    def _commit(self, n, lens, accepted, new_bonus, drafts, kinds, Bv) -> dict[int, list[int]]:
        """After a verify of rows 0..n-1 (old lengths lens [n]): the cache keeps each row's bonus and accepted
        drafts (the first accepted[r] of drafts [n, >= max accepted], which must sit in the cache's next slots),
        the new bonus waits for the next step, and the row emits drafts + bonus. kinds: per row, which
        acceptance statistics the step counts towards (None: an AR step). -> {id: emitted tokens}"""
        self.totals["target_forwards"] += 1
        self.cache.lens[:n] = lens + accepted + 1
        self.state.bonus[:n] = new_bonus
        self.state.ndrafts[:n] = 0
        acc = accepted.tolist()
        if kinds is not None:
            self.last_stats.accepted = acc
            for kind in set(kinds) - {None}:
                self.acceptance.record(kind, Bv, [a for a, k in zip(acc, kinds) if k == kind])
        drafts, bonus = drafts.tolist(), new_bonus.tolist()
        out, mode = {}, self.last_stats.mode
        for r in range(n):
            self.slots[r].forwards += 1
            self.slots[r].modes[mode] = self.slots[r].modes.get(mode, 0) + 1
            if kinds is not None:
                self.slots[r].accepted.append(acc[r])
            out[self.slots[r].id] = self._emit(r, drafts[r][: acc[r]] + [bonus[r]])
        return out

    def _verify_tree(self, n: int, Bv: int, depth, parent, nodes, kinds) -> dict[int, list[int]]:
        """Rows 0..n-1: the target verifies a token tree per row (the bonus, then nodes [n, N] at depth [n, N]
        <= Bv with parent [n, N], sorted by depth: a drafter tree from `draft_tree`, or lookup chains merged by
        `chain_trie`) in one forward. Greedy rows accept the deepest node whose path equals the target's own
        greedy continuation; sampled rows walk the tree by `tree_sample`. Node i + 1's keys/values go to cache
        slot lens + 1 + i; the accepted path's are then moved to lens + 1 .. lens + a, where a chain's would be.
        kinds: per row, the acceptance statistics the step counts towards."""
        dev = self.target.device
        lens = self.cache.lens[:n].clone()
        N = depth.shape[1]
        tokens = torch.cat((self.state.bonus[:n, None], nodes), dim=1)  # [n, N + 1]
        anc = tree_ancestors(parent)  # [n, N + 1, N + 1]
        pos = lens[:, None] + torch.cat((depth.new_zeros(n, 1), depth), dim=1)
        slots = lens[:, None] + torch.arange(N + 1, device=dev)
        span = int(lens.max()) + N + 1
        rel = torch.arange(span, device=dev) - lens[:, None, None]  # [n, 1, span]: slot - lens
        tree_part = anc.gather(2, rel.clamp(0, N).expand(n, N + 1, span)) & (rel >= 0) & (rel <= N)
        mask = (rel < 0) | tree_part  # [n, N + 1, span]: the row's prefix and the node's own path
        view = self.cache.rows(0, n)
        logits = self._timed("target", lambda: self.target.logits(
            self.target(tokens, pos, view, mask=mask, span=span, slots=slots)), n, N + 1)
        top = argmax_tokens(logits)  # [n, N + 1]
        accepted, node = tree_walk(nodes == top.gather(1, parent), anc, depth)
        new_bonus = top.gather(1, node[:, None]).squeeze(1)
        for r in range(n):
            params = self.slots[r].params
            if not params.greedy:
                p = filtered_logits(logits[r], params).softmax(-1)  # [N + 1, V]
                node[r], new_bonus[r] = tree_sample(p, tokens[r], parent[r], self.slots[r].generator)
                accepted[r] = 0 if node[r] == 0 else depth[r, node[r] - 1]
        # the accepted path's nodes in depth order (nodes are sorted by depth), then their cache slots moved
        path = anc[torch.arange(n, device=dev), node, 1:]  # [n, N]
        index = torch.arange(1, N + 1, device=dev)
        src = torch.where(path, index, N + 1).sort(-1).values[:, :Bv]  # [n, Bv]: the first accepted[r] count
        dst = torch.arange(1, Bv + 1, device=dev).expand(n, Bv)
        src = torch.where(dst <= accepted[:, None], src, dst)
        rows = torch.arange(n, device=dev)[:, None]
        for kv in (*view.k, *view.v):  # [n, Hkv, S, D]
            kv[rows, :, lens[:, None] + dst] = kv[rows, :, lens[:, None] + src]
        return self._commit(n, lens, accepted, new_bonus, tokens.gather(1, src.clamp(max=N)), kinds, Bv)

    def _target_logits(self, tokens, pos, cache) -> torch.Tensor:
        """[n, T] tokens -> [n, T, V] logits (the LM head is timed with the forward: at batch 1 it is ~15%)."""
        return self.target.logits(self.target(tokens, pos, cache))

    def _parallel_logits(self, tokens, pos, cache, anchors):
        """-> clean logits [n, T, V], branch hidden states [n, m, T, d]."""
        h, hb = parallel_forward(self.target, self.drafter, tokens, pos, cache, anchors)
        return self.target.logits(h), hb

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor):
        """logits [n, T, V] at the verify tokens, drafts [n, Bv] -> accepted drafts [n], next bonus [n]: greedy
        rows by `greedy_accept`, sampled rows by `speculative_sample` with their own filters and generator."""
        accepted, bonus = greedy_accept(logits, drafts)
        for i, row in enumerate(rows.tolist()):
            req = self.slots[row]
            if not req.params.greedy:
                p = filtered_logits(logits[i], req.params).softmax(-1)  # [T, V]
                q = self.state.q[row, :drafts.shape[1]] if drafts.shape[1] else None  # (AR steps: no drafts)
                a, b = speculative_sample(p, drafts[i], q, req.generator)
                accepted[i], bonus[i] = a, b
        return accepted, bonus

    def _branches(self, n: int, Bv: int, cap: int) -> torch.Tensor:
        """Selective verification: rows 0..n-1's branch anchors [n, m], most probable first (`branch_anchors`)."""
        band = self.band(n)
        anchors = branch_anchors(self.state.conf[:n, :Bv], band.rho, band.top_m, cap)
        self.last_stats.branches = float(anchors.shape[1])
        return anchors

    def _take_branches(self, hb, anchors, accepted, new_bonus, Bv) -> None:
        """hb [n, m, Bv+1, d]: the branch whose anchor equals the accepted length becomes the row's drafts
        (calibrated with the bonus); rows whose branch was pruned draft sequentially next step."""
        n = anchors.shape[0]
        hit = anchors == accepted[:, None]  # [n, m]
        rows = hit.any(-1).nonzero().squeeze(-1)
        misses = n - rows.numel()
        self.last_stats.pruned_misses = misses
        self.totals["pruned_misses"] += misses
        self.totals["parallel_rows"] += n
        if not rows.numel():
            return
        branch = hit[rows].float().argmax(-1)
        h = hb[rows, branch, 1:]  # [r, Bv, d]
        if self.config.calibrate:
            h = self.drafter.calibrate(self.target, h, new_bonus[rows, None].expand(-1, Bv))
        self._set_drafts(rows, self.target.logits(h), from_branch=True)

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
                self.cache.lens[r] = self.cache.lens[last]
                self.state.move(last, r)
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

