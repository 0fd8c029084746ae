"""A request's options while the engine speculates: logprobs, penalties, logit bias and min_tokens, each against an
independent reference (`transformers`' logits of the same weights in fp32, the penalties written out here as
OpenAI and vLLM define them), in every mode with drafts accepted while the option is on; and the n choices of one
prompt sharing its prefill."""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ragged_prompts
from engine_fixtures import CPU32, OracleProposer, drafters, tiny, tiny_folder, tiny_vocabulary  # noqa: F401 (fixtures)
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams
from test_engine import chi_square_ok, marginal

MODES = [("sequential", {}), ("parallel", {}), ("tree", {}), ("adaptive", {"switch_batch": 3}), ("lookup", {})]
IDS = ["sequential", "parallel", "tree", "adaptive", "lookup"]


@pytest.fixture(scope="module")
def hf(tiny_folder):
    return AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: transformers' logits after each token."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


def processed(raw: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, stop: set[int]):
    """The reference: raw logits [V] after the request's logit_bias and min_tokens (vLLM's logits processors),
    then repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    x = raw.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        x[sorted(stop)] = float("-inf")
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(x)).double()
    seen = counts > 0
    seen[prompt] = True
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()


def reference_greedy(hf, prompt: list[int], p: SamplingParams, stop: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < p.max_new_tokens:
        token = int(processed(hf_logits(hf, prompt + out)[-1], prompt, out, p, stop).argmax())
        out.append(token)
        if token in stop:
            break
    return out


def run(engine: Engine, prompts, params) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    return [engine.result(i) for i in ids]


@pytest.mark.parametrize("mode,extra", MODES, ids=IDS)
def test_logprobs_are_the_targets_whichever_step_emitted_the_token(tiny, drafters, hf, mode, extra):
    """Greedy and sampled rows side by side asking for 3 alternatives: each token's log-probability and its top 3
    (ids in order, values) equal log_softmax of transformers' logits at that position (1e-4), whether the token was
    a prefill's, an accepted draft, a lookup draft or a bonus; greedy tokens are transformers' argmax."""
    prompts = ragged_prompts(6, seed=31)
    params = [SamplingParams(max_new_tokens=20, logprobs=3, **({"temperature": 0.9, "seed": i} if i % 2 else {}))
              for i in range(len(prompts))]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode=mode, max_batch=4, max_len=96, **extra))
    out = run(engine, prompts, params)
    assert engine.totals.num_accepted_tokens > 0  # drafts were accepted while logprobs were on
    for prompt, g, p in zip(prompts, out, params):
        assert len(g.logprobs) == len(g.token_ids) == 20
        ref = hf_logits(hf, prompt + g.token_ids)[len(prompt) - 1: -1].log_softmax(-1)  # [20, V]
        if p.greedy:
            assert g.token_ids == ref.argmax(-1).tolist()
        top = ref.topk(3, dim=-1)
        for j, lp in enumerate(g.logprobs):
            assert lp.token == g.token_ids[j]
            assert lp.logprob == pytest.approx(float(ref[j, lp.token]), abs=1e-4)
            assert [t for t, _ in lp.top] == top.indices[j].tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values[j].tolist(), abs=1e-4)


PROCESSING = [
    SamplingParams(max_new_tokens=24, repetition_penalty=1.6),
    SamplingParams(max_new_tokens=24, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(max_new_tokens=24, logit_bias=((11, 2.5), (40, -100.0))),
    SamplingParams(max_new_tokens=24, min_tokens=12, presence_penalty=0.5),
]


@pytest.mark.parametrize("mode,extra", MODES, ids=IDS)
def test_penalties_bias_and_min_tokens_greedy_are_the_references(tiny, drafters, hf, mode, extra):
    """Rows with a repetition penalty, presence + frequency penalties, a logit bias, min_tokens, and plain rows, in
    one batch: each row's greedy tokens equal the reference's (transformers' logits processed as OpenAI / vLLM
    define it), each processing changes some row's output, and the engine speculated."""
    prompts = ragged_prompts(10, seed=41)
    plain = SamplingParams(max_new_tokens=24)
    free = generate(tiny, prompts, plain)
    eos = free[0].token_ids[5]  # a token rows emit: min_tokens holds it back
    params = [PROCESSING[i % 4] if i < 8 else plain for i in range(len(prompts))]
    refs = [reference_greedy(hf, p, sp, {eos}) for p, sp in zip(prompts, params)]
    unprocessed = [reference_greedy(hf, p, plain, {eos}) for p in prompts]
    for k in range(4):  # each kind of processing changes what some row says
        assert any(refs[i] != unprocessed[i] for i in range(k, 8, 4)), PROCESSING[k]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode=mode, max_batch=4, max_len=96, **extra),
                    eos_token_ids=[eos])
    out = run(engine, prompts, params)
    assert [g.token_ids for g in out] == refs
    assert engine.totals.num_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["sequential", "tree"])
def test_penalties_count_the_drafts_accepted_earlier_in_the_same_step(tiny, drafters, hf, mode, monkeypatch):
    """Drafts forced to the reference continuation, so every step accepts a whole block: the output is the
    reference's only because each position's penalty counts the drafts before it on its path. With those counts
    dropped (the penalty applied to the output before the step only) the same run comes out different."""
    prompts = ragged_prompts(4, seed=43)
    params = SamplingParams(max_new_tokens=24, presence_penalty=1.5, frequency_penalty=1.0)
    refs = [reference_greedy(hf, p, params, set()) for p in prompts]
    reference = {tuple(p): r for p, r in zip(prompts, refs)}

    def decode():
        engine = Engine(tiny, drafters["random"], EngineConfig(mode=mode, max_batch=4, max_len=96))
        engine.proposer = OracleProposer(engine, reference, wrong=False)
        return run(engine, prompts, [params] * len(prompts))

    out = decode()
    assert [g.token_ids for g in out] == refs
    assert all(max(g.stats.accepted_lengths) == 4 for g in out)  # whole blocks accepted
    import flexdraft.speculative.penalties as penalties

    monkeypatch.setattr(penalties, "path_counts", lambda drafts, rows, tokens: torch.zeros(len(rows), 1, tokens.shape[1]))
    assert [g.token_ids for g in decode()] != refs


def test_bad_processing_is_named():
    for kw, word in (({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": 1e-45},
                      "repetition_penalty"), ({"repetition_penalty": 5e-324}, "repetition_penalty"),
                     ({"min_tokens": 9}, "min_tokens"),
                     ({"logit_bias": ((-1, 1.0),)}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
                     ({"presence_penalty": float("nan")}, "presence_penalty")):
        with pytest.raises(FlexDraftError, match=word):
            SamplingParams(max_new_tokens=8, **kw)


def exact_processed(hf, prompt: list[int], p: SamplingParams, stop: set[int], n_tokens: int) -> dict[tuple, float]:
    """P(the first n_tokens, or fewer ending in a stop token) by enumerating every continuation: transformers'
    logits, processed as the reference says, at temperature 1."""
    probs, done = {(): 1.0}, {}
    for _ in range(n_tokens):
        nxt = {}
        for seq, q in probs.items():
            dist = processed(hf_logits(hf, prompt + list(seq))[-1], prompt, list(seq), p, stop).softmax(-1)
            for t in dist.nonzero().squeeze(-1).tolist():
                (done if t in stop else nxt)[seq + (t,)] = q * float(dist[t])
        probs = nxt
    return probs | done


def tally(engine: Engine, prompt: list[int], params: list[SamplingParams]) -> dict[tuple, int]:
    """How often each output comes out of the requests, from an engine that verified drafts and both accepted and
    rejected some."""
    counts: dict[tuple, int] = {}
    for g in run(engine, [prompt] * len(params), params):
        counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
    t = engine.totals
    assert t.num_drafts > 0 and 0 < t.num_accepted_tokens < t.num_draft_tokens, (engine.config.mode, t)
    return counts


def test_sampling_with_penalties_follows_the_processed_distribution(tmp_path, monkeypatch):
    """Tiny vocabulary (12 tokens), temperature 1, presence + frequency + repetition penalties, a logit bias and
    min_tokens 2 (EOS held back for two tokens): the first 3 tokens of 6000 sampled generations in sequential,
    parallel, tree and lookup mode, with a random drafter whose q is far from p, match the enumerated distribution
    of the reference by chi-square at significance 0.001, in runs that accepted and rejected drafts. The same test
    fails when a position's penalty ignores the drafts before it in its step (the test has power)."""
    model, drafter = tiny_vocabulary(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [3, 7, 5, 9]
    params = SamplingParams(max_new_tokens=3, temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                            repetition_penalty=1.3, logit_bias=((5, 1.0),), min_tokens=2)
    exact = exact_processed(reference, prompt, params, {2}, 3)
    N = 6000

    def counts(mode):
        engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=64, max_len=24), eos_token_ids=[2])
        return tally(engine, prompt, [dataclasses.replace(params, seed=i) for i in range(N)])

    for mode in ("sequential", "parallel", "tree", "lookup"):
        seen = counts(mode)
        stat, q = chi_square_ok(seen, exact, N)
        assert stat < q, (mode, stat, q)
        for j in (1, 2):
            stat, q = chi_square_ok(marginal(seen, j), marginal(exact, j), N)
            assert stat < q, (mode, f"position {j}", stat, q)
    import flexdraft.speculative.penalties as penalties

    monkeypatch.setattr(penalties, "path_counts", lambda drafts, rows, tokens: torch.zeros(len(rows), 1, tokens.shape[1]))
    stat, q = chi_square_ok(counts("sequential"), exact, N)
    assert stat > q, "no power"


def test_choices_of_one_prompt_share_a_prefill_and_decode_as_if_alone(tiny, drafters, monkeypatch):
    """Three requests of one prompt (n = 3: greedy, and sampled with seeds 1 and 2) and one of another, admitted in
    one step: two prompts are prefilled, not four, and each request's tokens are what it gets decoded alone."""
    import flexdraft.engine.engine as engine_module

    prompts = ragged_prompts(2, seed=45)
    params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=16, temperature=1.0, seed=2), SamplingParams(max_new_tokens=16)]
    asked = [prompts[0]] * 3 + [prompts[1]]
    config = EngineConfig(mode="sequential", max_batch=4, max_len=96)
    alone = [run(Engine(tiny, drafters["trained"], config), [p], [sp])[0].token_ids for p, sp in zip(asked, params)]
    prefilled = []
    real = engine_module.prefill
    monkeypatch.setattr(engine_module, "prefill", lambda m, c, ps: prefilled.append(len(ps)) or real(m, c, ps))
    engine = Engine(tiny, drafters["trained"], config)
    out = run(engine, asked, params)
    assert prefilled == [2] and [g.token_ids for g in out] == alone
    assert out[1].token_ids != out[2].token_ids  # (the seeds differ)


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(tiny_smollm2):
    """A tiny random llama with SmolLM2's tokenizer (grammars need a real one), transformers' copy of it, and an
    untrained drafter."""
    lm = load_model(tiny_smollm2, CPU32)
    torch.manual_seed(0)
    drafter = Drafter.from_target(lm.model, DrafterConfig(k=2, block_size=4)).to_runtime(lm.model)
    return lm, AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float32).eval(), drafter


def grammar_reference(hf, tokenizer, prompt: list[int], grammar: str, n: int) -> list[int]:
    """Greedy under the grammar, straight from llguidance's matcher and transformers' logits."""
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf.config.vocab_size), grammar)
    out: list[int] = []
    while len(out) < n:
        logits = hf_logits(hf, prompt + out)[-1]
        bias = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[: len(logits)]
        token = int(logits.masked_fill(bias == 0, float("-inf")).argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert m.consume_token(token)
    return out


@pytest.mark.parametrize("mode,extra,drafts", [(*m, None) for m in MODES] + [
    ("sequential", {}, "right"), ("sequential", {}, "wrong"), ("tree", {}, "right"), ("tree", {}, "wrong")],
    ids=IDS + ["sequential-right", "sequential-wrong", "tree-right", "tree-wrong"])
def test_json_schema_output_is_the_constrained_reference_and_validates(smol, mode, extra, drafts):
    """Greedy under a JSON schema, in every mode while it speculates, and with drafts forced to the constrained
    reference (every block accepted) or to tokens that never match (each rejected, many forbidden by the grammar):
    the tokens are the reference's (transformers' logits masked by llguidance's own matcher) and the text parses
    and validates against the schema. Rows without a grammar in the same batch are unconstrained."""
    import json

    import jsonschema

    from flexdraft.core.data import chat_ids
    from flexdraft.speculative.grammar import Grammar, Grammars

    lm, hf, drafter = smol
    tok = lm.tokenizer
    prompts = [chat_ids(tok, [{"role": "user", "content": f"Describe item {i} as JSON."}]) for i in range(3)]
    grammar = Grammar.json_schema(SCHEMA)
    refs = [grammar_reference(hf, tok, p, grammar.compiled(), 40) for p in prompts]
    plain = SamplingParams(max_new_tokens=12)
    free = run(Engine(lm.model, None, EngineConfig(mode="ar", max_batch=4, max_len=256), eos_token_ids=[2]),
               prompts[:1], [plain])[0].token_ids
    engine = Engine(lm.model, drafter, EngineConfig(mode=mode, max_batch=4, max_len=256, **extra),
                    eos_token_ids=[tok.eos_token_id], grammars=Grammars(tok, lm.model.args.vocab_size))
    if drafts is not None:
        reference = {tuple(p): r for p, r in zip(prompts, refs)} | {tuple(prompts[0]): refs[0]}
        engine.proposer = OracleProposer(engine, reference, wrong=drafts == "wrong")
    params = [SamplingParams(max_new_tokens=40, grammar=grammar)] * 3
    out = run(engine, prompts + prompts[:1], params + [plain])
    assert [g.token_ids for g in out[:3]] == refs
    for g in out[:3]:
        assert g.finish_reason == "eos"
        jsonschema.validate(json.loads(tok.decode(g.token_ids, skip_special_tokens=True)), SCHEMA)
    if drafts is None:
        assert out[3].token_ids == free  # the unconstrained row beside them
    assert engine.totals.num_drafts > 0
    if drafts == "right":
        assert engine.totals.num_accepted_tokens > sum(map(len, refs)) / 2


SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("mode", ["sequential", "tree"])
def test_the_grammar_wins_over_min_tokens_and_ignore_eos(smol, mode):
    """min_tokens past where the value completes, and ignore_eos, greedy and sampled, with drafts: each choice
    ends with EOS right after its complete JSON value (the grammar allows nothing else there) and parses; a
    request without a grammar still runs to min_tokens / max_tokens as it asks."""
    import json

    import jsonschema

    from flexdraft.core.data import chat_ids
    from flexdraft.speculative.grammar import Grammar, Grammars

    lm, _, drafter = smol
    tok = lm.tokenizer
    prompt = chat_ids(tok, [{"role": "user", "content": "Is it ok? Answer as JSON."}])
    engine = Engine(lm.model, drafter, EngineConfig(mode=mode, max_batch=8, max_len=256),
                    eos_token_ids=[tok.eos_token_id], grammars=Grammars(tok, lm.model.args.vocab_size))
    grammar = Grammar.json_schema(SHORT)
    asks = [dict(min_tokens=30), dict(ignore_eos=True), dict(min_tokens=30, ignore_eos=True)]
    params = [SamplingParams(max_new_tokens=40, grammar=grammar, **ask, **how) for ask in asks
              for how in (dict(), dict(temperature=1.0, seed=3))]
    free = [SamplingParams(max_new_tokens=40, min_tokens=30), SamplingParams(max_new_tokens=40, ignore_eos=True)]
    out = run(engine, [prompt] * (len(params) + 2), params + free)
    for g in out[:-2]:
        assert g.finish_reason == "eos" and g.token_ids[-1] == tok.eos_token_id
        assert tok.eos_token_id not in g.token_ids[:-1] and len(g.token_ids) < 30
        jsonschema.validate(json.loads(tok.decode(g.token_ids, skip_special_tokens=True)), SHORT)
    assert len(out[-2].token_ids) >= 30 and tok.eos_token_id not in out[-2].token_ids[:29]
    assert len(out[-1].token_ids) == 40


def test_a_grammar_that_fails_mid_answer_ends_it_with_an_error_not_eos(smol):
    """A schema llguidance compiles but cannot follow past its first token (600 optional properties: a parser row
    over its 2,000-item limit after a lone `{`, which logit_bias makes the first token) ends the request with
    finish_reason "error" and llguidance's reason, never "eos" with text that does not parse; a `$ref` cycle is
    refused when it is compiled, before any token."""
    from flexdraft.core.data import chat_ids
    from flexdraft.speculative.grammar import Grammar, Grammars

    lm, _, drafter = smol
    tok = lm.tokenizer
    grammars = Grammars(tok, lm.model.args.vocab_size)
    with pytest.raises(FlexDraftError, match="grammar is not valid"):
        grammars.compile(Grammar.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                              "$ref": "#/$defs/a"}))
    wide = Grammar.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}})
    engine = Engine(lm.model, drafter, EngineConfig(mode="sequential", max_batch=4, max_len=256),
                    eos_token_ids=[tok.eos_token_id], grammars=grammars)
    prompt = chat_ids(tok, [{"role": "user", "content": "JSON please."}])
    plain = SamplingParams(max_new_tokens=12)
    brace = tok.convert_tokens_to_ids("{")
    out = run(engine, [prompt, prompt], [SamplingParams(max_new_tokens=40, grammar=wide, logit_bias=((brace, 100.0),)),
                                         plain])
    assert out[0].finish_reason == "error" and "max is 2000" in out[0].error
    assert out[1].finish_reason == "length" and out[1].error is None  # (its neighbour is untouched)


def test_a_compiled_grammar_is_copied_per_choice_not_compiled_on_the_engine_thread(smol, monkeypatch):
    """A request's grammar compiled once (`Grammars.compile`, as a server does off the engine thread) is only copied
    when its 16 choices are added (compiling a large schema per choice on the engine thread stalled every stream
    for seconds), and the choices decode exactly as under the plain grammar."""
    import llguidance

    from flexdraft.core.data import chat_ids
    from flexdraft.speculative import grammar as grammar_module
    from flexdraft.speculative.grammar import Grammar, Grammars

    lm, _, drafter = smol
    tok = lm.tokenizer
    grammars = Grammars(tok, lm.model.args.vocab_size)
    prompt = chat_ids(tok, [{"role": "user", "content": "Is it ok? Answer as JSON."}])
    compiled = grammars.compile(Grammar.json_schema(SHORT))
    built = []

    real = llguidance.LLMatcher

    class Counting:  # (llguidance's type cannot be subclassed: this counts its constructions)
        def __new__(cls, *args, **kwargs):
            built.append(1)
            return real(*args, **kwargs)

    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", Counting)
    engine = Engine(lm.model, drafter, EngineConfig(mode="sequential", max_batch=16, max_len=256),
                    eos_token_ids=[tok.eos_token_id], grammars=grammars)
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, grammar=compiled) for i in range(16)]
    ids = [engine.add_request(prompt, p) for p in params]
    assert built == []
    while engine.has_work():
        engine.step()
    out = [engine.result(i).token_ids for i in ids]
    monkeypatch.undo()
    plain = [dataclasses.replace(p, grammar=Grammar.json_schema(SHORT)) for p in params]
    engine = Engine(lm.model, drafter, EngineConfig(mode="sequential", max_batch=16, max_len=256),
                    eos_token_ids=[tok.eos_token_id], grammars=grammars)
    assert [g.token_ids for g in run(engine, [prompt] * 16, plain)] == out


def byte_level_tokenizer(vocab: list[str]):
    """A fast byte-level BPE tokenizer whose tokens are exactly `vocab` (no merges): what llguidance takes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", bos_token="<s>", pad_token="<pad>")


def test_sampling_under_a_grammar_follows_the_masked_distribution(tmp_path, monkeypatch):
    """Tiny vocabulary (12 tokens, a byte-level tokenizer of single letters), temperature 1, the regex
    (a|b)(c|d)(e|f): the 3 tokens of 3000 sampled generations in sequential, parallel, tree and lookup mode match
    the enumerated distribution of transformers' logits masked by llguidance, by chi-square at significance
    0.001, in runs that accepted and rejected drafts, and nothing outside the grammar comes out; with each position
    masked as if no draft came before it, outputs outside the grammar do (the test has power)."""
    import llguidance

    from flexdraft.speculative.grammar import Grammar, Grammars

    model, drafter = tiny_vocabulary(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok = byte_level_tokenizer(["<pad>", "<s>", "</s>", *"abcdefghi"])
    grammar = Grammar("regex", "(a|b)(c|d)(e|f)")  # (which tokens may come depends on the tokens before)
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=12)

    def allowed(seq) -> torch.Tensor:
        m = llguidance.LLMatcher(ll, grammar.compiled())
        assert m.consume_tokens(list(seq))
        return torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[:12] > 0

    prompt = [3, 5, 7, 4, 6, 8]  # "acebdf": prompt lookup proposes what the grammar allows after a and after b
    exact, probs = {}, {(): 1.0}
    for _ in range(3):
        nxt = {}
        for seq, q in probs.items():
            dist = hf_logits(reference, prompt + list(seq))[-1].masked_fill(~allowed(seq), float("-inf")).softmax(-1)
            for t in dist.nonzero().squeeze(-1).tolist():
                (exact if t == 2 else nxt)[seq + (t,)] = q * float(dist[t])
        probs = nxt
    exact |= probs
    assert len(exact) == 8
    N = 3000  # (8 outcomes)

    def counts(mode):
        engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=64, max_len=24), eos_token_ids=[2],
                        grammars=Grammars(tok, 12))
        return tally(engine, prompt, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, grammar=grammar)
                                      for i in range(N)])

    for mode in ("sequential", "parallel", "tree", "lookup"):
        seen = counts(mode)
        assert set(seen) <= set(exact), mode  # nothing outside the grammar
        stat, q = chi_square_ok(seen, exact, N)
        assert stat < q, (mode, stat, q)
    import flexdraft.speculative.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "draft_paths", lambda drafts, row: [[]] * (1 + (drafts.nodes if drafts else 0)))
    assert set(counts("sequential")) - set(exact), "no power"  # forbidden tokens get through
