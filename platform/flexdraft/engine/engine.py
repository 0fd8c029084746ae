"""The FlexDraft decoding engine (docs/design.md): lossless speculative decoding with a drafter that
drafts over the target's own KV cache, in sequential or parallel mode, with continuous batching.

Shapes: n = active rows (rows 0..n-1 of every buffer and of the cache), Bv = drafts verified per row (<= the
drafter's block size), N = draft nodes per row (a chain: Bv), m = branches kept per row (parallel mode),
V = vocabulary, d = model width.

Per row the engine holds `lens` (tokens in the cache), `bonus` (the last emitted token, not yet in the cache:
it sits at position lens) and, in `RowState`, drafts a parallel step's matched branch left for the next step.
A step hands values from part to part:
  1. admit waiting requests (prefill, draw the first token: the row's bonus; a step that admits ends there), or
  2. plan (`Plan`, no side effect: the policy's band, or the adaptive planner's choice; a `Proposer`'s
     drafts ride in the plan of a lookup step, which names it);
  3. propose: the step's `Drafts`, a token tree per row (a chain: each node hangs from the one before), from the
     drafter (`proposers.DrafterProposer`) or the plan;
  4. verify [bonus, nodes] per row in one target forward (`verification.Verifier`; parallel mode: candidate draft
     blocks carried through the same forward), `rejection_sample` -> `Verdict`, commit what was accepted, tell
     every proposer (`Proposer.after_verify`), retire finished rows (the last row moves into the freed one)
     -> `StepOutput`.
Lossless: every emitted token is the target's argmax (greedy) or drawn by speculative sampling against
the target's distribution; the drafts only decide how many of them one forward yields.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence

import torch

from flexdraft.core.errors import ContextTooLong, FieldError, FlexDraftError
from flexdraft.drafter.model import Drafter
from flexdraft.engine import profiling
from flexdraft.engine.ar import prefill
from flexdraft.engine.config import EngineConfig, resolve
from flexdraft.engine.options import committed_logprobs, emitted_logprobs, processed, shared_prefills
from flexdraft.engine.proposer_api import (
    Proposer,
    ProposerContext,
    Verified,
    acceptance_rate,
    build_proposer,
    check_name,
    check_option,
)
from flexdraft.engine.proposers import DrafterProposer, LookupProposer, critical_rows
from flexdraft.engine.scheduler import Scheduler
from flexdraft.engine.state import Request, RowState, count_acceptance, draft_caps, speculating_share
from flexdraft.engine.stats import IDLE, PREFILL, Recovery, RequestDelta, SpecDecodingStats, StepOutput, StepStats
from flexdraft.engine.timing import StepTimer
from flexdraft.engine.verification import Verifier
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.branches import branch_anchors
from flexdraft.speculative.drafts import Chains, Drafts, Mode, Plan, Verdict
from flexdraft.speculative.grammar import Grammars
from flexdraft.speculative.lookup import NgramIndex, NgramStore
from flexdraft.speculative.planner import LOOKUP_MARGIN, Planner
from flexdraft.speculative.policy_file import Band, Policy
from flexdraft.speculative.sampling import Generation, SamplingBatch, SamplingParams, make_generator
from flexdraft.speculative.verify import rejection_sample

# the knobs `reconfigure` may change on a live engine (the rest size its buffers or pick its parts)
LIVE_KNOBS = ("switch_batch", "top_m", "rho", "calibrate", "cost_model")


class Engine:
    """Continuous-batching speculative decoder over preallocated buffers.

    `add_request(prompt_ids, params) -> id`, `step(admit_limit) -> StepOutput` (a `RequestDelta` per request that
    made tokens), `abort(id)`, `result(id)`; `generate` is a thin loop over them. Requests beyond `max_batch` wait
    and are admitted as rows finish, fairly between the groups (clients) that sent them (`Scheduler`)."""

    def __init__(self, target: Transformer, drafter: Drafter | None, config: EngineConfig, eos_token_ids=(),
                 acceptance_prior: dict | None = None, store: NgramStore | None = None, policy: Policy | None = None,
                 proposers: Sequence[Proposer] = (), grammars: Grammars | None = None):
        """config: as asked (`config.resolve` makes the one the engine runs with, `self.config`). policy: the step
        settings per live batch size (`policy_file`); it sets the config's mode (adaptive), S, cost model and the
        largest block, tree and n-gram size its bands use. The caller checks it was measured for this target and
        drafter (`runner.resolve_policy`). proposers: draft sources weighed beside prompt lookup (adaptive and
        lookup steps), after those `config.proposers` names (`proposer_api`). grammars: compiles requests'
        grammars against the target's tokenizer (None: requests with a grammar are refused)."""
        config = resolve(config, drafter, target.args.max_position_embeddings, policy)
        self.target, self.drafter, self.config, self.policy = target, drafter, config, policy
        if drafter is not None and drafter.paired is None:
            raise FlexDraftError("the drafter is not ready for inference: call drafter.to_runtime(target) first "
                                 "(runner.resolve_drafter does)")
        if drafter is not None:
            self.B = config.block_size or drafter.config.block_size
        else:
            self.B = (config.block_size or 8) if config.mode == Mode.LOOKUP else 0
        # proposers' drafts (prompt lookup's: n-grams of up to `lookup` tokens; 0: none); adaptive weighs them by
        # cost only
        weighed = config.mode == Mode.LOOKUP or (config.mode == Mode.ADAPTIVE and (config.cost_model or policy))
        self.lookup = config.lookup if weighed else 0
        self.store = store if self.lookup else None  # a corpus's drafts beside the request's own (lookup steps)
        self.eos = set(eos_token_ids)
        self.grammars = grammars
        R, dev = config.max_batch, target.device
        self.cache = target.new_cache(R, config.max_len)
        self.trees = bool(self.B and config.tree_nodes and config.mode in (Mode.TREE, Mode.ADAPTIVE))
        self.state = RowState.empty(R, max(self.B, 1), min(config.tree_width, target.args.vocab_size)
                                    if self.trees else 1, dev)
        self.scheduler = Scheduler(R)  # the requests: waiting, in rows (request of cache row r), finished
        self._ids = itertools.count()
        # the proposers: the drafter's drafts (engine/proposers.py); the others' (`Proposer`), prompt lookup's first
        self.proposers: list[Proposer] = [LookupProposer(self.B, self.store)] if self.lookup else []
        if (config.proposers or proposers) and not weighed:
            raise FlexDraftError(f"proposers are weighed in mode lookup, or adaptive with its cost model or a policy, "
                                 f"not in mode {config.mode}" + (" without one" if config.mode == Mode.ADAPTIVE else ""))
        context = ProposerContext(target, self.B, self.store)
        self.proposers += [build_proposer(name, context, settings) for name, settings in config.proposers.items()]
        self.proposers += list(proposers)
        for p in self.proposers:
            check_name(getattr(p, "name", None))
        self.planner = Planner(self.B, config.switch_batch, config.tree_nodes, self.trees, config.cost_model,
                               acceptance_prior, config.online, functools.partial(acceptance_rate, self.proposers))
        self.acceptance, self.costs = self.planner.acceptance, self.planner.costs
        # times the forwards (the parts that run them hold it, not the engine: an engine is freed when dropped)
        self.timed = StepTimer(dev, self.costs)
        self.proposer = DrafterProposer(target, drafter, self.cache, self.state, self.trees, self.timed) \
            if drafter is not None else None
        self.verifier = Verifier(target, drafter, self.cache, self.state, self.timed)
        self.totals = SpecDecodingStats()  # since start
        self.pruned_misses = 0  # parallel steps' rows whose accepted length fell on a pruned branch, since start

    def reconfigure(self, **knobs) -> dict:
        """Change live policy knobs (`LIVE_KNOBS`; a policy's own knobs are its bands') -> those that changed.
        Checked whole before any is applied; plans are re-priced at their next use. The one way to change them."""
        unknown = set(knobs) - set(LIVE_KNOBS)
        if unknown:
            raise FlexDraftError(f"not a live engine knob: {', '.join(sorted(unknown))} (live: {', '.join(LIVE_KNOBS)})")
        changed = {k: v for k, v in knobs.items() if v != getattr(self.config, k)}
        new = dataclasses.replace(self.config, **changed)
        new.check(self.drafter, self.target.args.max_position_embeddings)
        self.config = new
        self.planner.switch_batch, self.planner.cost_model = self.config.switch_batch, self.config.cost_model
        self.planner.forget_plans()
        return changed

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
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= V]
            if bad:
                raise FieldError(name, f"{name} has token id {bad[0]} outside the vocabulary of {V}")
        if params.grammar is not None and self.grammars is None:
            raise FlexDraftError("this engine has no tokenizer to compile grammars with (Engine(grammars=...))")
        need = self.slots_needed(len(prompt), params.max_new_tokens)
        if need > self.config.max_len:
            raise ContextTooLong(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} + "
                                 f"{need - len(prompt) - params.max_new_tokens} verify and branch slots = {need} "
                                 f"exceeds the cache of {self.config.max_len} slots per row (engine max_len)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, group=None) -> int:
        """Queue a request -> its id. group: who sent it (hashable; None: a group of its own), e.g. a server's
        client, whose requests (or the n choices of one) share the batch fairly with other groups' (`scheduler`)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.check_request(prompt, params)
        V = self.target.args.vocab_size
        rid = next(self._ids)
        group = ("request", rid) if group is None else group
        req = Request(rid, prompt, params, make_generator(params, self.target.device), group=group,
                      index=NgramIndex(prompt, self.lookup) if self.lookup else None, stop=params.stop_ids(self.eos),
                      logprobs=[] if params.logprobs is not None else None,
                      matcher=self.grammars.matcher(params.grammar) if params.grammar is not None else None)
        if not params.greedy and self.state.q is None and self.B:
            self.state.q = torch.zeros(self.config.max_batch, self.B, V, device=self.target.device)
        self.scheduler.add(req)
        return req.id

    def slots_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots a request needs: its tokens, the verify block and, when parallel steps may run, the
        branch tokens' scratch past the verify block ((B+1)^2 at most), or a token tree's nodes."""
        branches = (self.B + 1) ** 2 if self.config.mode in (Mode.PARALLEL, Mode.ADAPTIVE) else 0
        tree = max([self.config.tree_nodes + 1 if self.trees else 0]
                   + [p.scratch_slots(self.B) for p in self.proposers])
        return prompt_len + max_new_tokens + max(self.B + 1 + branches, tree)

    @property
    def stats(self) -> StepStats:
        """The step under way (between steps: the last one)."""
        return self.timed.stats

    @stats.setter
    def stats(self, value: StepStats) -> None:
        self.timed.stats = value

    @property
    def clock(self):
        """What steps and forwards are timed with (the cost model learns from it)."""
        return self.timed.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.timed.clock = clock

    def abort(self, request_id: int) -> None:
        """Drop a waiting or running request; the other rows are untouched."""
        self.scheduler.abort(request_id, self._move_row)

    def result(self, request_id: int) -> Generation:
        """The finished (or aborted) request's generation; the engine forgets it (a server calls this once
        per request it added)."""
        req = self.scheduler.result(request_id)
        for p in self.proposers:
            p.release(request_id)
        return req.generation()

    @property
    def slots(self) -> list[Request]:
        """The running requests: slots[r] holds cache row r."""
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def active(self) -> int:
        return len(self.slots)

    def has_work(self) -> bool:
        return bool(self.slots or self.waiting)

    def queue(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(running, waiting) request ids, in row and queue order (as a `StepOutput` reports them)."""
        return self.scheduler.ids()

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self, admit_limit: int | None = None) -> StepOutput:
        """One step: admit waiting requests (prefill, first tokens; at most admit_limit of them, None: as rows
        free up, e.g. 1 while a server isolates a failure), else plan, propose, verify every row."""
        t0 = self.clock()
        stats = self.stats = StepStats(IDLE, 0)  # this step's, filled as it goes
        # a step that admits ends with the first tokens: they stream after the prefill alone
        deltas = self._admit(admit_limit)
        self.scheduler.retire(self._move_row)
        n = len(self.slots)
        decoding = bool(n and not stats.admitted)
        if decoding:
            reqs = self.slots[:n]
            batch = self._sampling(reqs)
            caps = torch.tensor(draft_caps(reqs, self.B, self.config.online), dtype=torch.long,
                                device=self.target.device)
            plan = self.plan(n, caps)
            stats.mode, stats.proposer, stats.rows, stats.block = plan.mode, plan.proposer, n, plan.block
            deltas = self.verify(plan, self.propose(plan, caps, batch), caps, batch)
            self.scheduler.retire(self._move_row)
        self.timed.sync()
        stats.seconds = self.clock() - t0
        stats.tokens = sum(len(d.tokens) for d in deltas)
        if decoding:
            forwards = sum(stats.forward_seconds.values())
            self.costs.record_step(stats.kind, stats.seconds, forwards)
            self.planner.observe(plan, forwards)
        self.totals.observe(stats)
        return StepOutput(tuple(d for d in deltas if d.tokens or d.finish_reason), stats, *self.queue())

    def _parallel_may_follow(self, n: int) -> bool:
        """Whether a parallel step may come at n rows (its pruning weighs the drafts' confidences)."""
        mode = self.band(n).mode
        return mode == Mode.PARALLEL or (mode == Mode.ADAPTIVE and n <= self.config.switch_batch)

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

    def plan(self, n: int, caps: torch.Tensor | None = None) -> Plan:
        """The plan of a step with n rows, by their band: a fixed mode (lookup: AR when no row has a match), or
        adaptive: the planner's (`Planner.adaptive`, weighing each row by its cap and its own acceptance),
        unless one of this step's proposers' options promises more. No side effect: the drafts a lookup plan verifies
        ride in it."""
        band = self.band(n)
        Bv = band.block or self.B
        if band.mode == Mode.LOOKUP:
            return self.model_free_plan(n, Bv) or Plan(Mode.AR)
        if band.mode != Mode.ADAPTIVE:
            mode = Mode(band.mode)
            return Plan(mode, 0 if mode == Mode.AR else Bv, nodes=band.tree_nodes if mode == Mode.TREE else 0)
        fresh = int((self.state.ndrafts[:n] == 0).sum())
        share = 1.0 if caps is None or not self.config.online else speculating_share(self.slots[:n], caps.tolist(), Bv)
        plan, rate = self.planner.adaptive(n, fresh, self.totals.num_steps, band, share)
        if self.proposers and rate is not None:  # against an AR step, a margin (see LOOKUP_MARGIN)
            rate_to_beat = rate * (LOOKUP_MARGIN if plan.mode == Mode.AR else 1.0)
            return self.weigh_model_free(n, band, rate_to_beat) or plan
        return plan

    def _sampling(self, requests: list[Request]) -> SamplingBatch:
        return SamplingBatch.of([r.params for r in requests], [r.generator for r in requests], self.target.device)

    def _options(self, n: int, band: Band, first: list[int] | None) -> list[Chains]:
        """Every proposer's candidate drafts for rows 0..n-1 (`Proposer.options`), each named by its source and
        checked: a proposer's bug is a FlexDraftError naming it, not a wrong verify."""
        options, V = [], self.target.args.vocab_size
        for p in self.proposers:
            for option in p.options(self.slots[:n], band, first):
                check_option(option, p, n, band.block or self.B, p.scratch_slots(self.B), V)
                options.append(dataclasses.replace(option, source=p.name))
        return options

    def _lookup_plan(self, option: Chains, Bv: int) -> Plan:
        n = len(option.kinds)
        return Plan(Mode.LOOKUP, Bv, proposer=option.source,
                    drafts=option.drafts(Bv, self.state.bonus[:n].tolist(), self.target.device))

    def model_free_plan(self, n: int, Bv: int) -> Plan | None:
        """A lookup step of Bv drafts per row over the option whose rows are expected to accept the most drafts
        (`Planner.expected_accepted`; the first of equals), None when no option matches anywhere."""
        options = self._options(n, self.band(n), None)
        if not options:
            return None
        return self._lookup_plan(max(options, key=lambda o: self.planner.expected_accepted(o, Bv)), Bv)

    def weigh_model_free(self, n: int, band: Band, rate_to_beat: float) -> Plan | None:
        """The proposers' best option if it promises more than rate_to_beat tokens/s (`Planner.lookup`);
        it needs a match in every row that sets when the batch drains (`critical_rows`)."""
        critical = critical_rows(self.slots[:n], self.B, bool(self.waiting))
        options = self._options(n, band, critical)
        best = self.planner.lookup(options, critical, rate_to_beat, band.block or self.B) if options else None
        return self._lookup_plan(options[best[1]], best[0].block) if best else None

    def propose(self, plan: Plan, caps: torch.Tensor, batch: SamplingBatch) -> Drafts:
        """The drafts the plan verifies for rows 0..n-1 (n = len(caps))."""
        if plan.drafts is not None:
            return plan.drafts
        if plan.mode == Mode.AR:
            return Drafts.none(caps.shape[0], self.target.device)
        return self.proposer.propose(plan, caps, self.slots, batch, self._parallel_may_follow(caps.shape[0]))

    def profile(self, context: int = 256, rounds: int = 5, timer=None) -> dict:
        """Seed the cost model with the measured forwards the planner prices (`profiling.profile`)."""
        return profiling.profile(self, context, rounds, timer)

    def _admit(self, limit: int | None) -> list[RequestDelta]:
        """Prefill the requests the scheduler takes (`Scheduler.admit`: fair between groups, preempting rows for a
        group that holds none; at most `limit`) into free rows (longest first) -> their deltas (each its next
        token). A request that comes back from `recover` or a preemption prefills its prompt and the tokens it had
        made, and goes on from there (a sampled one keeps its generator)."""
        new, self.stats.preempted = self.scheduler.admit(limit, self._move_row)
        if not new:
            return []
        new.sort(key=lambda r: -(len(r.prompt) + len(r.tokens)))
        # requests with the same tokens (the n choices of one prompt) share a prefill: the first of them is
        # prefilled, the others' rows (after the prefilled ones) copy its cache row
        new, unique, of = shared_prefills(new)
        n0 = len(self.slots)
        self.slots.extend(new)  # rows first: a prefill that raises leaves them to `recover`, not lost
        stats = self.stats  # a prefill step: its rows decode from the next step on
        stats.mode, stats.admitted, stats.admitted_ids = PREFILL, len(new), [r.id for r in new]
        rows = torch.arange(n0, n0 + len(new), device=self.target.device)
        view = self.cache.rows(n0, n0 + len(unique))
        h = self.timed("prefill", lambda: prefill(self.target, view, [r.prompt + r.tokens for r in unique]))
        for row in range(len(unique), len(new)):
            self.cache.copy_row(n0 + of[row], n0 + row)
        logits = self.target.logits(h)[torch.tensor(of, device=h.device), None]  # [k, 1, V]
        first = self._sampling(new).sample(processed(logits, new, None)[:, 0])  # [k]
        self.state.bonus[rows] = first
        self.state.ndrafts[rows] = 0
        logprobs = emitted_logprobs(logits, new, first[:, None])
        return [req.emit([tok], logprobs.get(i)) for i, (req, tok) in enumerate(zip(new, first.tolist()))]

    def recover(self) -> Recovery:
        """After a step that raised: every request in a row goes back to the front of the waiting queue (one that
        had finished, to `finished`) with the tokens it has made -> those tokens of these and of every finished
        request not yet collected (the failed step may have finished and retired it before raising, its last
        tokens undelivered), and the requests the failed step was admitting. A re-queued request's next
        admission prefills prompt + tokens, so it goes on where it stood; the failed step's cache writes, drafts
        and plans are dropped. Greedy outputs are unchanged by this; sampled ones keep their generator's stream."""
        back = self.scheduler.requeue()
        self.cache.lens.zero_()
        self.state.ndrafts.zero_()
        self.planner.forget_plans()
        finished = self.scheduler.finished
        requests = (*back, *finished.values())
        tokens = {req.id: list(req.tokens) for req in requests}
        logprobs = {req.id: list(req.logprobs) for req in requests if req.logprobs is not None}
        return Recovery(tokens, list(finished), list(self.stats.admitted_ids), logprobs, self.queue()[1])

    # ---------------------------------------------------------------- verification

    def verify(self, plan: Plan, drafts: Drafts, caps: torch.Tensor, batch: SamplingBatch) -> list[RequestDelta]:
        """One target forward over [bonus, nodes] of rows 0..n-1 (a parallel plan: the most probable branches ride
        along, `branch_anchors`), the rejection sampler over at most caps [n] drafts per row, the accepted path
        committed -> each row's delta; a parallel step's matched branches become the rows' next
        drafts. The sampler judges against the logits as each request's penalties make them (`options.processed`)."""
        n = drafts.rows
        lens = self.cache.lens[:n].clone()
        anchors = None
        if plan.mode == Mode.PARALLEL:
            band = self.band(n)
            anchors = branch_anchors(drafts.probs, band.rho, band.top_m, plan.branches)  # [n, m]
            self.stats.branches = float(anchors.shape[1])
        logits, h, hb = self.verifier.forward(drafts, lens, anchors)
        verdict = rejection_sample(processed(logits, self.slots[:n], drafts), drafts, caps, batch)
        out = self._commit(lens, drafts, verdict, caps, plan.block, logits)
        verified = Verified(self.slots[:n], plan, drafts, verdict, h, logits)
        if hb is not None:
            misses = self.proposer.take_branches(verified, hb, anchors, batch, self.config.calibrate,
                                                 self._parallel_may_follow(n))
            self.stats.pruned_misses = misses
            self.pruned_misses += misses
        for p in self.proposers:
            p.after_verify(verified)
        return out

    def _commit(self, lens: torch.Tensor, drafts: Drafts, verdict: Verdict, caps: torch.Tensor,
                block: int, logits: torch.Tensor) -> list[RequestDelta]:
        """After a verify of rows 0..n-1 (old lengths lens [n], logits [n, N + 1, V]): the accepted path's
        keys/values sit where a chain's would (a tree's are moved there), the cache keeps each row's bonus and
        accepted drafts, the new bonus waits for the next step, and the row emits drafts + bonus (with their
        logprobs where asked) -> each row's delta."""
        n, accepted = drafts.rows, verdict.accepted
        path, src = drafts.tokens, None  # src [n, Bv]: the verify index of each path node (a chain: 1..N)
        if not drafts.chain:
            path, src = self.verifier.move_path(lens, drafts, verdict)
        logprobs = committed_logprobs(logits, self.slots[:n], path, src, verdict, drafts.nodes)
        self.cache.lens[:n] = lens + accepted + 1
        self.state.bonus[:n] = verdict.bonus
        self.state.ndrafts[:n] = 0
        acc = accepted.tolist()
        kinds = [k if c else None for k, c in zip(drafts.kinds, caps.tolist())]  # (a row capped at 0: AR)
        self.stats.accepted = count_acceptance(self.slots[:n], self.acceptance, acc, kinds, caps.tolist(), block)
        path, bonus, out = path.tolist(), verdict.bonus.tolist(), []
        for r in range(n):
            req = self.slots[r]
            mode = self.stats.kind if kinds[r] is not None else Mode.AR.value
            req.forwards += 1
            req.modes[mode] = req.modes.get(mode, 0) + 1
            if mode != Mode.AR:
                req.accepted.append(acc[r])
            lp = logprobs.get(r)
            out.append(req.emit(path[r][: acc[r]] + [bonus[r]], lp[: acc[r] + 1] if lp else None))
        return out

    def _move_row(self, src: int, dst: int) -> None:
        """Row src's cached prefix and state into row dst (the scheduler fills a freed row with the last one)."""
        self.cache.copy_row(src, dst)
        self.state.move(src, dst)

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
