"""Grammar-constrained decoding (OpenAI's `response_format`): a request's grammar as a value (`Grammar`), compiled
by llguidance against the target's tokenizer (`Grammars`) into a `Matcher` per request, which says for each verify
position which tokens may come next, given the request's output and the drafts on that position's path.

The engine masks the target's logits with it before the rejection sampler (`constrained`), so every draft is
judged against the constrained distribution: a draft the grammar forbids has probability 0 and is never accepted,
and the bonus is drawn from the masked distribution. The matcher consumes only emitted tokens; the drafts it walks
to mask a step's positions are rolled back at once, so nothing is left to undo after a rejection.

Shapes: T = verify positions per row (1 + N draft nodes), V = vocabulary."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

import llguidance
import llguidance.hf
import numpy as np
import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.speculative.drafts import Drafts

KINDS = ("json_schema", "regex", "lark")
# JSON is laid out as json.dumps lays it out, with no free whitespace: a model cannot stall in blank space
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: a JSON schema (as JSON text), a regular expression, or a Lark grammar."""
    kind: str
    spec: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise FlexDraftError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @staticmethod
    def json_schema(schema: dict) -> Grammar:
        return Grammar("json_schema", json.dumps(schema, sort_keys=True))

    def compiled(self) -> str:
        """llguidance's form of the grammar (FlexDraftError naming what is wrong with it), made once: a server checks
        it while parsing the request, off the engine thread, which then finds it made."""
        return self._compiled

    @cached_property
    def _compiled(self) -> str:
        try:
            if self.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_LAYOUT)
            elif self.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(self.spec)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(self.spec)
        except ValueError as e:
            raise FlexDraftError(f"the {self.kind} grammar is not valid: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise FlexDraftError(f"the {self.kind} grammar is not valid: {error}")
        return grammar


JSON_OBJECT = Grammar.json_schema({"type": "object"})  # response_format json_object: any JSON object


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against one tokenizer (`Grammars.compile`): its matcher at the start of an answer, which
    each request decoding under it copies (a copy costs microseconds; compiling a large schema, seconds). A server
    compiles it while parsing the request and hands it to the engine as `SamplingParams.grammar`, so the engine
    thread never compiles."""
    grammar: Grammar
    start: llguidance.LLMatcher
    tokenizer: llguidance.LLTokenizer  # (the one it was compiled against)


class Grammars:
    """Compiles grammars against one tokenizer (a fast `transformers` tokenizer; its llguidance form is built at
    the first grammar, ~0.4 s for SmolLM2's). vocab_size: the target's (its logits' V)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.V = tokenizer, vocab_size
        self._ll: llguidance.LLTokenizer | None = None

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The grammar against this tokenizer, its first position's mask computed: FlexDraftError naming what is
        wrong with it, where llguidance can tell before any token (a `$ref` cycle, an unknown keyword)."""
        if self._ll is None:
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.V)
        m = llguidance.LLMatcher(self._ll, grammar.compiled(), log_level=0)
        if not m.is_error():
            m.compute_bitmask()
        if m.is_error():
            raise FlexDraftError(f"the {grammar.kind} grammar is not valid: {_first_line(m.get_error())}")
        return CompiledGrammar(grammar, m, self._ll)

    def matcher(self, grammar: Grammar | CompiledGrammar) -> Matcher:
        """A request's matcher: a copy of the compiled grammar's start (a `Grammar` is compiled first)."""
        if isinstance(grammar, Grammar) or grammar.tokenizer is not self._ll:
            grammar = self.compile(grammar if isinstance(grammar, Grammar) else grammar.grammar)
        return Matcher(grammar.start.deep_copy(), self.V, self.tokenizer.eos_token_id)


class Matcher:
    """One request's grammar state: where its emitted tokens have brought it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: int | None):
        self.m, self.V, self.eos = matcher, vocab_size, eos

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (llguidance's words: a limit of its parser reached mid-answer, a token it
        forbids), None while it can. A matcher in error stays in error."""
        if not self.m.is_error():
            return None
        return _first_line(self.m.get_error()) or "the grammar failed"

    def words(self, paths: list[list[int]]) -> torch.Tensor:
        """[T, W] int32: the bitmask (bit j of word w: token 32 w + j) of the tokens allowed at each verify position,
        whose path (the drafts before it) is paths[t]. A position behind a draft the grammar forbids is never reached
        (that draft is rejected first): it allows every token."""
        width = (self.V + 31) // 32
        out = torch.full((len(paths), width), -1, dtype=torch.int32)
        for t, path in enumerate(paths):
            walked = self.m.try_consume_tokens(path) if path else 0
            try:
                if walked == len(path):
                    words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)
                    out[t] = 0
                    out[t, : min(width, words.numel())] = words[:width]
            finally:
                if walked:
                    self.m.rollback(walked)
        return out

    def consume(self, tokens: list[int]) -> None:
        """The request emitted these tokens (a token the grammar forbids puts it in an error state: `error`)."""
        for token in tokens:  # (one at a time: consume_tokens refuses the EOS that ends a complete value)
            self.m.consume_token(token)


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it dumps after it."""
    return error.strip().split("\n", 1)[0][:500]


def draft_paths(drafts: Drafts | None, row: int) -> list[list[int]]:
    """The drafts before each verify position of a row: [] at the bonus's, a node's path (its ancestors' tokens
    and its own, root first) after it. [[]] without drafts."""
    if drafts is None or not drafts.nodes:
        return [[]]
    paths = [[]]
    for token, parent in zip(drafts.tokens[row].tolist(), drafts.parent[row].tolist()):
        paths.append(paths[parent] + [token])  # (parents come before their children)
    return paths


def constrained(logits: torch.Tensor, rows: list[int], matchers: list[Matcher], drafts: Drafts | None) -> torch.Tensor:
    """logits [n, T, V] -> a copy with the tokens each of `rows`' grammar forbids at each position at -inf (a
    position where it allows nothing, an error state, allows only EOS: the request ends, with `Matcher.error`)."""
    n, T, V = logits.shape
    words = torch.stack([m.words(draft_paths(drafts, r)) for r, m in zip(rows, matchers)])  # [s, T, W]
    octets = words.numpy().astype("<i4", copy=False).view(np.uint8)  # (token 32 w + j: bit j of word w)
    allowed = torch.from_numpy(np.unpackbits(octets, axis=-1, bitorder="little")).view(len(rows), T, -1)
    allowed = allowed[..., :V].bool()  # [s, T, V]
    for i, m in enumerate(matchers):
        if m.eos is not None:
            allowed[i, ~allowed[i].any(-1), m.eos] = True
    at = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[at] = torch.where(allowed.to(logits.device), out[at], float("-inf"))
    return out
