"""Sampling: the request's parameters, the primitives every decoder draws with (argmax, top log-probabilities,
temperature / top-k / top-p filtering, inverse-CDF draws), and the result of one generation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.speculative.grammar import CompiledGrammar, Grammar

SAMPLING_EPS = 1e-5  # a temperature below this decodes greedily (as vLLM): logits / 1e-300 would be inf
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # the most alternatives a request may ask per token (OpenAI's top_logprobs bound, vLLM's default)
# vLLM takes any repetition penalty > 0; a seen token's logit is divided by it, so below ~1e-38 / |logit| it is inf
# and the distribution NaN (1e-45 sampled token V-1 forever). 0.01 already multiplies a seen logit by 100.
REPETITION_PENALTY_RANGE = (0.01, 10.0)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # below SAMPLING_EPS = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_draft_tokens: int | None = None  # at most this many drafts verified per step (0: no speculation; None: no cap)
    # when a request ends (what it emits, never which token it draws): vLLM's extensions
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end it (it runs to max_new_tokens)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end it, kept as its last token like an EOS
    min_tokens: int = 0  # its stop tokens cannot come before this many tokens (vLLM's)
    # what the target's distribution is processed by (speculative/penalties.py); each draft is judged against it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    presence_penalty: float = 0.0  # subtracted from each token the output holds
    frequency_penalty: float = 0.0  # times the token's count in the output, subtracted
    repetition_penalty: float = 1.0  # a token of the prompt or output: its logit divided by this if > 0, else times
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: none)
    # what the output must match (the engine masks the target's logits by it); a server passes it compiled
    grammar: Grammar | CompiledGrammar | None = None

    def __post_init__(self):
        def number(name, value, integer=False):
            ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
            if not ok or isinstance(value, bool):
                raise FlexDraftError(f"{name} must be {'an integer' if integer else 'a finite number'}, got {value!r}")

        number("max_new_tokens", self.max_new_tokens, integer=True)
        number("temperature", self.temperature)
        number("top_p", self.top_p)
        number("top_k", self.top_k, integer=True)
        if self.max_new_tokens <= 0:
            raise FlexDraftError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise FlexDraftError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FlexDraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FlexDraftError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_draft_tokens is not None:
            number("max_draft_tokens", self.max_draft_tokens, integer=True)
            if self.max_draft_tokens < 0:
                raise FlexDraftError(f"max_draft_tokens must be >= 0 (0: no speculation), got {self.max_draft_tokens}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids):
            raise FlexDraftError(f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)}")
        number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise FlexDraftError(f"min_tokens must be between 0 and max_new_tokens ({self.max_new_tokens}), "
                                 f"got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            number(name, getattr(self, name))
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise FlexDraftError(f"repetition_penalty must be between {low} and {high} (1: off), "
                                 f"got {self.repetition_penalty}")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 0
            if not ok or isinstance(pair[0], bool):
                raise FlexDraftError(f"logit_bias must hold (token id, bias) pairs, got {pair!r}")
            number(f"logit_bias[{pair[0]}]", pair[1])
        if self.logprobs is not None:
            number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise FlexDraftError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.grammar is not None and not isinstance(self.grammar, (Grammar, CompiledGrammar)):
            raise FlexDraftError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise FlexDraftError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def processes(self) -> bool:
        """Whether the target's logits are processed for this request (penalties, bias or min_tokens)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Whether the request asks only for its tokens (no penalties, bias, min_tokens, grammar or logprobs): what
        any decoder serves, `ar.generate` and the benchmark's transformers and peer methods among them."""
        return not (self.processes or self.grammar is not None or self.logprobs is not None)

    def stop_ids(self, eos) -> set[int]:
        """The tokens that end this request, given the model's end-of-sequence ids. Under a grammar EOS always ends
        it, ignore_eos or not: the grammar allows EOS only where its value is complete, and nothing after it."""
        keep_eos = self.grammar is not None or not self.ignore_eos
        return (set(eos) if keep_eos else set()) | set(self.stop_token_ids)


def _vocab_chunks(x: torch.Tensor) -> torch.Tensor | None:
    """[..., V] -> [M, V / c, c]: the vocabulary in chunks of c = the largest power of two <= 1024 dividing V
    (None where that is under 64: small vocabularies take the plain path)."""
    V = x.shape[-1]
    c = min(1024, V & -V)
    return x.reshape(-1, V // c, c) if c >= 64 and V >= 4 * c else None


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the argmax over the vocabulary, the first index among equal maxima (as torch.argmax).
    Through each chunk's maximum, then the argmax inside the first chunk holding the largest: on the 2-core CPU
    torch's argmax over 49k entries runs at ~0.7 G entries/s (16 rows x 9 verify tokens: 15 ms next to a 100 ms
    forward), its amax ~5x faster."""
    xs = _vocab_chunks(logits)
    if xs is None:
        return logits.float().argmax(-1)
    M, c = xs.shape[0], xs.shape[-1]
    best = xs.amax(-1).argmax(-1)  # [M]
    within = xs[torch.arange(M, device=xs.device), best].argmax(-1)
    return (best * c + within).view(logits.shape[:-1])


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] -> (fp32 log-probabilities [..., k] in descending order, their token ids [..., k]): the top k of
    log_softmax(logits). The k largest logits lie in the k chunks with the largest maxima, so the top-k runs
    over those only, and the normaliser is one pass of exp; log_softmax + topk over [16, 8, 49k] took 75 ms on
    the 2-core CPU, more than a 16-row verify forward."""
    xs = _vocab_chunks(logits)
    if xs is None or k > xs.shape[-1]:
        return logits.float().log_softmax(-1).topk(k, dim=-1)
    M, C, c = xs.shape
    cmax = xs.amax(-1)  # [M, C]
    chunks = cmax.topk(min(k, C), dim=-1).indices  # [M, k']
    vals, j = xs[torch.arange(M, device=xs.device)[:, None], chunks].reshape(M, -1).float().topk(k, dim=-1)
    ids = chunks.gather(1, j // c) * c + j % c
    m = cmax.amax(-1, keepdim=True).float()  # [M, 1]
    e = xs.reshape(M, -1).to(torch.float32, copy=True).sub_(m).exp_()
    lse = m + e.sum(-1, keepdim=True).log_()
    shape = (*logits.shape[:-1], k)
    return (vals - lse).view(shape), ids.view(shape)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> fp32 logits after the request's temperature, top-k and top-p (removed tokens at -inf).

    Speculative sampling must apply exactly this to both the target and the draft distributions."""
    return SamplingBatch.over([0], [params], [None], logits.device).filtered(logits[None])[0]


def top_p_drop(logits: torch.Tensor, top_p: torch.Tensor | float, first: int = 256) -> torch.Tensor:
    """[N, V] logits, top_p [N, 1] (or one for all) -> [N, V] bool: the tokens top-p removes. A token goes when
    the tokens ranked above it already cover top_p of the probability (the first always stays). Where a row's
    `first` most probable tokens hold top_p of its mass (a peaked distribution, the usual case) every token beyond
    them goes, so only those are ranked; other rows sort the whole vocabulary (1.8 ms per row of 49k on a CPU
    core)."""
    def cut(ranked: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # probabilities in descending order -> which go
        return ranked.cumsum(-1) - ranked >= p

    if not isinstance(top_p, torch.Tensor):
        top_p = torch.full((logits.shape[0], 1), float(top_p), device=logits.device)
    probs = logits.softmax(-1)
    top, order = probs.topk(min(first, probs.shape[-1]), dim=-1)  # [N, k], descending
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(-1, order, cut(top, top_p))
    wide = (top.cumsum(-1)[:, -1:] < top_p).squeeze(-1)  # [N]: the cut falls beyond the first k
    if wide.any():
        ranked, full = probs[wide].sort(dim=-1, descending=True)
        gone = cut(ranked, top_p[wide])
        drop[wide] = gone.scatter(-1, full, gone)
    return drop


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] non-negative weights -> [...] tokens drawn in proportion to them, by the inverse CDF: one
    uniform per row (torch.multinomial draws an exponential per vocabulary entry: 3 ms for 8 x 49k on a CPU
    core). A zero-weight token owns an empty interval and is never drawn."""
    u = torch.rand(weights.shape[:-1], generator=generator, dtype=torch.float64, device=weights.device)
    return inverse_cdf(weights, u)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[..., V] non-negative weights, [...] uniforms in [0, 1) -> [...] the tokens whose CDF interval holds u."""
    cdf = weights.double().cumsum(-1)
    x = (u.double()[..., None] * cdf[..., -1:]).contiguous()
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling settings of a step's rows, built once per step: which rows sample (the rest are greedy), and
    the sampled rows' temperatures, top-k, top-p and generators, as tensors over those rows, so the target's and
    the drafts' distributions are filtered for every sampled row in one pass. Each request keeps its own
    generator: every draw of row i comes from generators[i]."""
    sampled: torch.Tensor  # [s] indices of the sampled rows
    generators: tuple  # [s] their generators
    temperature: torch.Tensor  # [s] fp32
    top_k: torch.Tensor  # [s] (0 = off)
    top_p: torch.Tensor  # [s] fp32 (1 = off)

    @staticmethod
    def of(params: list[SamplingParams], generators: list, device="cpu") -> SamplingBatch:
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:  # every row greedy (the common step): nothing to build
            return GREEDY
        return SamplingBatch.over(rows, [params[i] for i in rows], [generators[i] for i in rows], device)

    @staticmethod
    def over(rows: list[int], params: list[SamplingParams], generators: list, device) -> SamplingBatch:
        """Rows `rows` sampling with params[i] and generators[i] (whatever their temperature)."""
        tensor = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
        return SamplingBatch(tensor(rows, torch.long), tuple(generators),
                             tensor([p.temperature for p in params], torch.float32),
                             tensor([p.top_k for p in params], torch.long),
                             tensor([p.top_p for p in params], torch.float32))

    @property
    def all_greedy(self) -> bool:
        return not self.generators

    def subset(self, rows: list[int]) -> SamplingBatch:
        """The batch over `rows` (indices of this batch's rows, in that order)."""
        if self.all_greedy:
            return self
        where = {r: i for i, r in enumerate(self.sampled.tolist())}
        pairs = [(j, where[r]) for j, r in enumerate(rows) if r in where]
        mine = torch.tensor([i for _, i in pairs], dtype=torch.long, device=self.sampled.device)
        return SamplingBatch(torch.tensor([j for j, _ in pairs], dtype=torch.long, device=self.sampled.device),
                             tuple(self.generators[i] for _, i in pairs), self.temperature[mine], self.top_k[mine],
                             self.top_p[mine])

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """[s, ..., V] logits of the sampled rows -> fp32 logits after each row's temperature, top-k and top-p
        (removed tokens at -inf)."""
        s, V = logits.shape[0], logits.shape[-1]
        x = logits.float() / self.temperature.view(s, *[1] * (logits.dim() - 1))
        flat = x.reshape(s, -1, V)
        k = torch.where((self.top_k > 0) & (self.top_k < V), self.top_k, 0)
        if bool(k.any()):
            kth = flat.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).clamp(min=0).view(s, 1, 1).expand(
                -1, flat.shape[1], 1))  # [s, T, 1]: each row's k-th largest
            flat = flat.masked_fill((flat < kth) & (k > 0).view(s, 1, 1), float("-inf"))
        if bool((self.top_p < 1).any()):
            p = self.top_p[:, None].expand(-1, flat.shape[1]).reshape(-1, 1)
            flat = flat.masked_fill(top_p_drop(flat.reshape(-1, V), p).view_as(flat), float("-inf"))
        return flat.view(x.shape)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[s, ..., V] logits of the sampled rows -> their filtered distributions (fp32)."""
        return self.filtered(logits).softmax(-1)

    def uniform(self, *shape: int, device="cpu") -> torch.Tensor:
        """[s, *shape] float64 uniforms, row i's from its own generator (one call per row, no host sync)."""
        return torch.stack([torch.rand(shape, generator=g, dtype=torch.float64, device=device)
                            for g in self.generators]) if self.generators else torch.zeros(0, *shape, device=device)

    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """[s, ..., V] non-negative weights -> [s, ...] tokens, row i's drawn with its own generator."""
        return inverse_cdf(weights, self.uniform(*weights.shape[1:-1], device=weights.device))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] logits of every row -> [n] next tokens: the argmax for greedy rows, a draw from each sampled
        row's filtered distribution."""
        tokens = argmax_tokens(logits)
        if not self.all_greedy:
            tokens[self.sampled] = self.draw(self.probs(logits[self.sampled]))
        return tokens


_none = torch.zeros(0, dtype=torch.long)
GREEDY = SamplingBatch(_none, (), _none.float(), _none, _none.float())


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] -> [N] next tokens: argmax when greedy, else a draw from the filtered distribution."""
    if params.greedy:
        return argmax_tokens(logits)
    return draw(filtered_logits(logits, params).softmax(-1), generator)


@dataclass
class GenerationStats:
    """How a request was decoded: accepted drafts per speculative step, tau (tokens per target forward after the
    prefill), its target forwards and their shares by step mode (e.g. {"ar": 0.25, "sequential": 0.75})."""
    accepted_lengths: list[int] = field(default_factory=list)
    tau: float = 1.0
    forwards: int = 0
    mode_share: dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    token_ids: list[int]  # generated ids only; ends with the EOS token if one was produced
    finish_reason: str  # "eos" | "length" | "time" (stopped by a deadline) | "abort" | "error" (see `error`)
    seconds: float  # this row's share of the batch's wall time
    prompt_len: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # per token (params.logprobs set)
    error: str | None = None  # why it ended with "error": its grammar could not go on (`grammar.Matcher.error`)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution (raw logits: before the request's
    penalties, temperature and top-k / top-p, as vLLM reports by default), and the most likely tokens there."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[list[TokenLogprob]]:
    """logits [s, P, V] at the positions that emitted tokens [s, P], ks [s] alternatives per row -> per row and
    position the token's TokenLogprob with its row's top k. One host read for the batch."""
    x = logits.float()
    lse = x.logsumexp(-1)  # [s, P]
    chosen = (x.gather(-1, tokens[..., None]).squeeze(-1) - lse).tolist()
    k = max(ks)
    top_lp, top_ids = top_logprobs(logits, k) if k else (lse[..., None][..., :0], tokens[..., None][..., :0])
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [[TokenLogprob(t, lp, tuple(zip(ids[:kr], lps[:kr])))
             for t, lp, ids, lps in zip(row_tokens, row_lp, row_ids, row_top)]
            for row_tokens, row_lp, row_ids, row_top, kr in zip(tokens.tolist(), chosen, top_ids, top_lp, ks)]


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


