"""The FlexDraft decoding engine (docs/design.md): lossless speculative decoding with a drafter that
drafts over the target's own KV cache, in sequential or parallel mode, with continuous batching.

Shapes: n = active rows (rows 0..n-1 of every buffer and of the cache), Bv = drafts verified this step
(<= the drafter's block size), T = Bv + 1 verify tokens per row, m = branches kept per row (parallel mode),
V = vocabulary, d = model width.

Per row the engine holds `lens` (tokens in the cache), `bonus` (the last emitted token, not yet in the cache:
it sits at position lens) and `ndrafts` drafts d_1.. for positions lens+1.. with their confidences (and
their full distributions q for sampled rows); `from_branch` says whether a parallel branch made them. A step
reads plan -> propose -> verify -> commit -> retire:
  1. admit waiting requests (prefill, draw the first token: the row's bonus; a step that admits ends there), or plan;
  2. propose: rows without drafts (fresh, pruned, after an AR or lookup step) get a drafter pass with the bonus
     known in slot 0 (`proposers.DrafterProposer`); a lookup step's drafts are prompt-lookup and n-gram-store
     chains (`proposers.LookupProposer`), several per row verified as one token trie, with no drafter;
  3. verify [bonus, d_1..d_Bv] per row in one target forward (tree mode: a token tree of each slot's top
     candidates; parallel mode: candidate draft blocks carried through the same forward, the one matching the
     accepted length kept), commit what was accepted, retire finished rows (the last row moves into the freed one).
Lossless: every emitted token is the target's argmax (greedy) or drawn by speculative sampling against
the target's distribution; the drafts only decide how many of them one forward yields.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque

import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter, parallel_forward
from flexdraft.engine.ar import prefill
from flexdraft.engine import profiling
from flexdraft.engine.config import NO_DRAFTER, EngineConfig, Mode
from flexdraft.engine.proposers import DrafterProposer, LookupProposer
from flexdraft.engine.state import Request, RowState, draft_caps, speculating_share
from flexdraft.engine.stats import IDLE, PREFILL, SpecDecodingStats, StepStats
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.branches import AcceptanceModel, Plan, branch_anchors
from flexdraft.speculative.lookup import NgramIndex, NgramStore
from flexdraft.speculative.planner import LOOKUP_MARGIN, Planner
from flexdraft.speculative.policy_file import Band, Policy
from flexdraft.speculative.sampling import (Generation, SamplingParams, argmax_tokens, filtered_logits,
                                            make_generator, sample)
from flexdraft.speculative.trees import (chain_trie, draft_tree, path_slots, tree_ancestors, tree_mask, tree_sample,
                                         tree_tokens, tree_walk)
from flexdraft.speculative.verify import accept_rows

# the knobs `reconfigure` may change on a live engine (the rest size its buffers or pick its parts)
LIVE_KNOBS = ("switch_batch", "top_m", "rho", "calibrate", "cost_model")


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
        self.eos = set(eos_token_ids)
        R, dev = config.max_batch, target.device
        self.cache = target.new_cache(R, config.max_len)
        self.trees = bool(self.B and config.tree_nodes and config.mode in ("tree", "adaptive"))
        self.state = RowState.empty(R, max(self.B, 1), min(config.tree_width, target.args.vocab_size)
                                    if self.trees else 1, dev)
        self.slots: list[Request] = []  # request of cache row r
        self.waiting: deque[Request] = deque()
        self.admit_limit: int | None = None  # at most this many admissions a step (a server isolating a failure)
        self.finished: dict[int, Request] = {}
        self._ids = itertools.count()
        self.planner = Planner(self.B, config.switch_batch, config.tree_nodes, self.trees, config.cost_model,
                               acceptance_prior, config.online)
        self.acceptance, self.costs = self.planner.acceptance, self.planner.costs
        # the proposers (engine/proposers.py): the drafter's drafts, prompt lookup's (+ the store's)
        self.proposer = DrafterProposer(target, drafter, self.cache, self.state, self.trees, self.timed) \
            if drafter is not None else None
        self.lookups = LookupProposer(self.B, self.store, self.planner)
        self.last_stats = StepStats(IDLE, 0)
        self.clock = time.perf_counter  # what steps and forwards are timed with (the cost model learns from it)
        self.totals = SpecDecodingStats()  # since start
        self.pruned_misses = 0  # parallel steps' rows whose accepted length fell on a pruned branch, since start

    def reconfigure(self, **knobs) -> dict:
        """Change live policy knobs (`LIVE_KNOBS`; a policy's own knobs are its bands') -> those that changed.
        Checked whole before any is applied; plans are re-priced at their next use. The one way to change them."""
        unknown = set(knobs) - set(LIVE_KNOBS)
        if unknown:
            raise FlexDraftError(f"not a live engine knob: {', '.join(sorted(unknown))} (live: {', '.join(LIVE_KNOBS)})")
        changed = {k: v for k, v in knobs.items() if v != getattr(self.config, k)}
        trial = dataclasses.replace(self.config, **changed)
        trial.check(self.drafter, self.target.args.max_position_embeddings)
        for k, v in changed.items():
            setattr(self.config, k, v)
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
        req = Request(next(self._ids), prompt, params, make_generator(params, self.target.device),
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
        return self.finished.pop(request_id).generation()

    @property
    def active(self) -> int:
        return len(self.slots)

    def has_work(self) -> bool:
        return bool(self.slots or self.waiting)

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> dict[int, list[int]]:
        """One step -> {id: new token ids}: admit waiting requests (prefill, first tokens), else decode every row."""
        t0 = self.clock()
        stats = self.last_stats = StepStats(IDLE, 0)  # this step's, filled as it goes
        out = self._admit()  # a step that admits ends with the first tokens: they stream after the prefill alone
        self._retire()
        n = len(self.slots)
        if n and not stats.admitted:
            caps = torch.tensor(draft_caps(self.slots[:n], self.B, self.config.online), dtype=torch.long,
                                device=self.target.device)
            plan = self.plan(n, caps)
            stats.mode, stats.rows, stats.block = plan.mode, n, plan.block
            if plan.mode not in NO_DRAFTER:  # (lookup drafts: written by _verify, as a chain or a trie)
                need = ((self.state.ndrafts[:n] < plan.block) & (caps > 0)).nonzero().squeeze(-1)
                if need.numel():
                    stats.drafted_rows = need.numel()
                    self.proposer.propose(need, plan.block, self.slots, self._parallel_may_follow(n))
            out = self._verify(n, plan, caps)
            self._retire()
        self._sync()
        stats.seconds = self.clock() - t0
        stats.tokens = sum(len(v) for v in out.values())
        if n and not stats.admitted:
            forwards = sum(stats.forward_seconds.values())
            self.costs.record_step(stats.mode, stats.seconds, forwards)
            self.planner.observe(plan, forwards)
        self.totals.observe(stats)
        return out

    def _parallel_may_follow(self, n: int) -> bool:
        """Whether a parallel step may come at n rows (its pruning weighs the drafts' confidences)."""
        mode = self.band(n).mode
        return mode == Mode.PARALLEL or (mode == Mode.ADAPTIVE and n <= self.config.switch_batch)

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, kind: str, fn, rows: int = 0, tokens: int = 0):
        """Run fn, add its wall time to this step's `last_stats` under `kind` and, for a forward of `rows` rows x
        `tokens` tokens each, to the cost model."""
        self._sync()
        t0 = self.clock()
        result = fn()
        self._sync()
        dt = self.clock() - t0
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

    def plan(self, n: int, caps: torch.Tensor | None = None) -> Plan:
        """The plan of a step with n rows, by their band: a fixed mode (lookup: AR when no row has a match), or
        adaptive: the planner's (`Planner.adaptive`, weighing each row by its cap and its own acceptance),
        unless this step's lookup drafts promise more."""
        band = self.band(n)
        Bv = band.block or self.B
        if band.mode == Mode.LOOKUP:
            return Plan("lookup", Bv) if self.lookups.propose(self.slots, n, band.lookup) else Plan("ar")
        if band.mode != Mode.ADAPTIVE:
            return Plan(band.mode, 0 if band.mode == Mode.AR else Bv)
        fresh = int((self.state.ndrafts[:n] == 0).sum())
        share = 1.0 if caps is None or not self.config.online else speculating_share(self.slots[:n], caps.tolist(), Bv)
        plan, rate = self.planner.adaptive(n, fresh, self.totals.num_steps, band, share)
        if band.lookup and rate is not None:  # against an AR step, a margin (see LOOKUP_MARGIN)
            rate_to_beat = rate * (LOOKUP_MARGIN if plan.mode == Mode.AR else 1.0)
            return self.lookups.plan(self.slots, n, band, rate_to_beat, bool(self.waiting)) or plan
        return plan

    def profile(self, context: int = 256, rounds: int = 5, timer=None) -> dict:
        """Seed the cost model with the measured forwards the planner prices (`profiling.profile`)."""
        return profiling.profile(self, context, rounds, timer)

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
        stats = self.last_stats  # a prefill step: its rows decode from the next step on
        stats.mode, stats.admitted, stats.admitted_ids = PREFILL, len(new), [r.id for r in new]
        rows = torch.arange(n0, n0 + len(new), device=self.target.device)
        view = self.cache.rows(n0, n0 + len(new))
        h = self.timed("prefill", lambda: prefill(self.target, view, [r.prompt + r.tokens for r in new]))
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

    # ---------------------------------------------------------------- verification

    def _verify(self, n: int, plan: Plan, caps: torch.Tensor) -> dict[int, list[int]]:
        """Target forward over [bonus, d_1..d_Bv] of rows 0..n-1 (+ branches in parallel mode), acceptance of at
        most caps [n] drafts per row, cache rollback by length -> {id: emitted tokens}."""
        mode, Bv = plan.mode, plan.block
        if mode == "tree":
            depth, parent, rank = draft_tree(self.state.cand_logp[:n, :Bv], self.band(n).tree_nodes)  # [n, N]
            nodes = tree_tokens(self.state.cand[:n, :Bv], depth, rank)
            return self._verify_tree(n, Bv, depth, parent, nodes, ["tree"] * n, caps)
        proposals = self.lookups.proposals
        if mode == "lookup" and any(len(chains) > 1 for chains, _ in proposals):  # verified as a token trie
            chains = [[c[:Bv] for c in cs] for cs, _ in proposals]
            depth, parent, nodes = chain_trie(chains, self.state.bonus[:n].tolist(), self.target.device)
            return self._verify_tree(n, Bv, depth, parent, nodes, [k for _, k in proposals], caps)
        if mode == "lookup":
            self.lookups.write(self.state, self.slots, n, Bv)
        dev, T = self.target.device, Bv + 1
        tokens = torch.cat((self.state.bonus[:n, None], self.state.drafts[:n, :Bv]), dim=1)  # [n, T]
        lens = self.cache.lens[:n].clone()
        pos = lens[:, None] + torch.arange(T, device=dev)
        view = self.cache.rows(0, n)
        if mode == "parallel":
            band = self.band(n)  # selective verification: the most probable branches first (`branch_anchors`)
            anchors = branch_anchors(self.state.conf[:n, :Bv], band.rho, band.top_m, plan.branches)  # [n, m]
            self.last_stats.branches = float(anchors.shape[1])
            logits, hb = self.timed("parallel", lambda: self.parallel_logits(tokens, pos, view, anchors),
                                     n, T * (1 + anchors.shape[1]))
        else:
            logits = self.timed("target", lambda: self.target_logits(tokens, pos, view), n, T)
            hb = None
        reqs = self.slots[:n]
        accepted, new_bonus = accept_rows(logits, tokens[:, 1:], caps, [r.params for r in reqs],  # [n], [n]
                                          [r.generator for r in reqs], self.state.q)
        if mode == "ar":
            kinds = None
        elif mode == "lookup":  # counted by n-gram size; rows without a match verified filler: not counted
            kinds = [kind for _, kind in proposals]
        else:
            kinds = ["parallel" if b else "sequential" for b in self.state.from_branch[:n].tolist()]
        out = self._commit(n, lens, accepted, new_bonus, self.state.drafts[:n, :Bv], kinds, Bv, caps)
        if hb is not None:
            misses = self.proposer.take_branches(hb, anchors, accepted, new_bonus, self.slots, self.config.calibrate,
                                                 self._parallel_may_follow(n))
            self.last_stats.pruned_misses = misses
            self.pruned_misses += misses
        return out

    def _commit(self, n, lens, accepted, new_bonus, drafts, kinds, Bv, caps=None) -> dict[int, list[int]]:
        """After a verify of rows 0..n-1 (old lengths lens [n]): the cache keeps each row's bonus and accepted
        drafts (the first accepted[r] of drafts [n, >= max accepted], which must sit in the cache's next slots),
        the new bonus waits for the next step, and the row emits drafts + bonus. kinds: per row, which
        acceptance statistics the step counts towards (None: an AR step; a row without drafts or capped at 0
        counts as one). -> {id: emitted tokens}"""
        self.cache.lens[:n] = lens + accepted + 1
        self.state.bonus[:n] = new_bonus
        self.state.ndrafts[:n] = 0
        acc = accepted.tolist()
        if kinds is not None and caps is not None:
            kinds = [k if c else None for k, c in zip(kinds, caps.tolist())]
        if kinds is not None:
            self.last_stats.accepted = [a for a, k in zip(acc, kinds) if k is not None]
            for r, kind in enumerate(kinds):  # a request's own acceptance, against the model's (drafter kinds)
                if kind in AcceptanceModel.KINDS:
                    cap = Bv if caps is None else min(Bv, int(caps[r]))
                    self.slots[r].acceptance.observe(acc[r], self.acceptance.expected_accepted(kind, cap))
            full = [k if caps is None or c >= Bv else None for k, c in zip(kinds, caps.tolist())]  # uncapped rows
            for kind in set(full) - {None}:
                self.acceptance.record(kind, Bv, [a for a, k in zip(acc, full) if k == kind])
        drafts, bonus = drafts.tolist(), new_bonus.tolist()
        out = {}
        for r in range(n):
            mode = self.last_stats.mode if kinds is not None and kinds[r] is not None else Mode.AR.value
            self.slots[r].forwards += 1
            self.slots[r].modes[mode] = self.slots[r].modes.get(mode, 0) + 1
            if mode != Mode.AR:
                self.slots[r].accepted.append(acc[r])
            out[self.slots[r].id] = self._emit(r, drafts[r][: acc[r]] + [bonus[r]])
        return out

    def _verify_tree(self, n: int, Bv: int, depth, parent, nodes, kinds, caps) -> dict[int, list[int]]:
        """Rows 0..n-1: the target verifies a token tree per row (the bonus, then nodes [n, N] at depth [n, N]
        <= Bv with parent [n, N], sorted by depth: a drafter tree from `draft_tree`, or lookup chains merged by
        `chain_trie`) in one forward. Greedy rows accept the deepest node whose path equals the target's own
        greedy continuation; sampled rows walk the tree by `tree_sample`. Node i + 1's keys/values go to cache
        slot lens + 1 + i; the accepted path's are then moved to lens + 1 .. lens + a, where a chain's would be.
        kinds: per row, the acceptance statistics the step counts towards; caps [n]: the deepest node a row may
        accept (its tree is cut below: the nodes sorted by depth, a prefix of them)."""
        dev = self.target.device
        lens = self.cache.lens[:n].clone()
        N = depth.shape[1]
        tokens = torch.cat((self.state.bonus[:n, None], nodes), dim=1)  # [n, N + 1]
        anc = tree_ancestors(parent)  # [n, N + 1, N + 1]
        pos = lens[:, None] + torch.cat((depth.new_zeros(n, 1), depth), dim=1)
        slots = lens[:, None] + torch.arange(N + 1, device=dev)
        span = int(lens.max()) + N + 1
        mask = tree_mask(anc, lens, span)  # [n, N + 1, span]
        view = self.cache.rows(0, n)
        logits = self.timed("target", lambda: self.target.logits(
            self.target(tokens, pos, view, mask=mask, span=span, slots=slots)), n, N + 1)
        top = argmax_tokens(logits)  # [n, N + 1]
        accepted, node = tree_walk((nodes == top.gather(1, parent)) & (depth <= caps[:, None]), anc, depth)
        new_bonus = top.gather(1, node[:, None]).squeeze(1)
        for r in range(n):
            params = self.slots[r].params
            if not params.greedy:
                k = int((depth[r] <= caps[r]).sum())  # the nodes within the cap
                p = filtered_logits(logits[r, : k + 1], params).softmax(-1)  # [k + 1, V]
                node[r], new_bonus[r] = tree_sample(p, tokens[r, : k + 1], parent[r, :k], self.slots[r].generator)
                accepted[r] = 0 if node[r] == 0 else depth[r, node[r] - 1]
        src = path_slots(anc, node, accepted, Bv)  # [n, Bv]: the accepted nodes' slots, lens + 1.. after them
        dst = torch.arange(1, Bv + 1, device=dev).expand(n, Bv)
        rows = torch.arange(n, device=dev)[:, None]
        for kv in (*view.k, *view.v):  # [n, Hkv, S, D]: the path's keys/values where a chain's would be
            kv[rows, :, lens[:, None] + dst] = kv[rows, :, lens[:, None] + src]
        return self._commit(n, lens, accepted, new_bonus, tokens.gather(1, src.clamp(max=N)), kinds, Bv, caps)

    def target_logits(self, tokens, pos, cache) -> torch.Tensor:
        """[n, T] tokens -> [n, T, V] logits (the LM head is timed with the forward: at batch 1 it is ~15%)."""
        return self.target.logits(self.target(tokens, pos, cache))

    def parallel_logits(self, tokens, pos, cache, anchors):
        """-> clean logits [n, T, V], branch hidden states [n, m, T, d]."""
        h, hb = parallel_forward(self.target, self.drafter, tokens, pos, cache, anchors)
        return self.target.logits(h), hb

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

