"""The OpenAI completions and chat-completions protocol over the engine: validated request models
(`serving.protocol`) to engine requests with OpenAI-style errors that name the field, prompts from text, token
ids or chat messages, incremental detokenisation with stop strings, and the response and stream-chunk bodies.
serving/ray_app.py puts them behind FastAPI."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from pydantic import ValidationError

from flexdraft.core.data import chat_ids
from flexdraft.core.errors import ContextTooLong, FieldError, FlexDraftError
from flexdraft.serving.protocol import ChatCompletionRequest, CompletionRequest
from flexdraft.speculative.grammar import JSON_OBJECT, Grammar
from flexdraft.speculative.sampling import SEED_RANGE, Generation, SamplingParams, TokenLogprob

# fields OpenAI defines that FlexDraft does not serve: refused by name unless at their no-op value
UNSUPPORTED = {
    "echo": lambda v: v not in (None, False), "suffix": lambda v: v is not None, "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"), "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "body"}  # union branches and FastAPI's root in locs


class APIError(Exception):
    """An error the client caused (4xx) or the server's state (5xx), with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A validated request: what the engine decodes and how the answer is shaped."""
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    return_token_ids: bool = False
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated (the n of highest log-probability are returned)
    id: str = ""
    created: int = 0
    max_tokens_given: bool = True  # False: the server's default, shortened to the room the cache leaves
    client: str = ""  # whose it is: its `user`, else the request itself (the engine shares rows fairly by it)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors -> one OpenAI error naming the first bad field."""
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if isinstance(x, int) or (x not in _TYPE_TAGS and x.isidentifier())]
    if e.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    if not loc:
        return APIError(400, "the request body must be a JSON object with the request's fields")
    param = str(loc[0])
    if e.get("type") == "extra_forbidden" and len(loc) == 1:
        return APIError(400, f"unknown field '{param}'", param)
    where = param + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
    return APIError(400, f"'{where}': {e.get('msg', 'invalid value')}", param)


def validate_body(body, chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """A decoded JSON body -> the validated request model; APIError naming the field otherwise."""
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def parse_request(body, chat: bool, served_model: str, tokenizer, max_tokens_limit: int,
                  default_max_tokens: int) -> Request:
    """The JSON body of POST /v1/completions (chat False) or /v1/chat/completions -> Request; APIError naming the
    field otherwise. max_tokens_limit: the most new tokens one request may ask for."""
    model = body if isinstance(body, (CompletionRequest, ChatCompletionRequest)) else validate_body(body, chat)
    for key, refused in UNSUPPORTED.items():
        if refused(getattr(model, key, None)):
            raise APIError(400, f"'{key}' is not supported by this server", key, code="unsupported_parameter")
    name = model.model or served_model
    if name != served_model:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{served_model}'", "model",
                       code="model_not_found")
    key = "max_completion_tokens" if chat and model.max_completion_tokens is not None else "max_tokens"
    given = getattr(model, key)
    if given is not None and given > max_tokens_limit:
        raise APIError(400, f"'{key}' must be between 1 and {max_tokens_limit}, got {given}", key)
    if model.stream_options is not None and not model.stream:
        raise APIError(400, "'stream_options' is only allowed with stream: true", "stream_options")
    best_of = model.n if chat or model.best_of is None else model.best_of
    if best_of < model.n:
        raise APIError(400, f"'best_of' ({best_of}) must be at least n ({model.n})", "best_of")
    if best_of > model.n and model.stream:
        raise APIError(400, "'best_of' cannot be streamed (the choices are ranked when all have finished)", "best_of")
    if model.seed is not None and model.seed + best_of - 1 > SEED_RANGE[1]:
        raise APIError(400, f"'seed' + choices - 1 must be at most {SEED_RANGE[1]} (choice i takes seed + i)", "seed")
    if chat and model.top_logprobs is not None and not model.logprobs:
        raise APIError(400, "'top_logprobs' is only allowed with logprobs: true", "top_logprobs")
    max_new = given or default_max_tokens
    if model.min_tokens > max_new:
        raise APIError(400, f"'min_tokens' ({model.min_tokens}) must not exceed {key} ({max_new})", "min_tokens")
    prompt_ids = _chat_prompt(model, tokenizer) if chat else _completion_prompt(model, tokenizer)
    grammar = _grammar(model.response_format)
    try:
        params = SamplingParams(max_new_tokens=max_new,
                                temperature=1.0 if model.temperature is None else float(model.temperature),
                                top_p=1.0 if model.top_p is None else float(model.top_p),
                                top_k=max(model.top_k or 0, 0), seed=model.seed,
                                max_draft_tokens=_draft_cap(model.flexdraft), ignore_eos=model.ignore_eos,
                                stop_token_ids=tuple(model.stop_token_ids or ()), min_tokens=model.min_tokens,
                                logit_bias=tuple((int(k), float(v)) for k, v in (model.logit_bias or {}).items()),
                                presence_penalty=float(model.presence_penalty or 0.0),
                                frequency_penalty=float(model.frequency_penalty or 0.0),
                                repetition_penalty=float(model.repetition_penalty or 1.0),
                                logprobs=(model.top_logprobs or 0 if model.logprobs else None) if chat else model.logprobs,
                                grammar=grammar)
    except FlexDraftError as e:  # (the schema's bounds are the engine's: this is a second line of defence)
        raise APIError(400, str(e)) from None
    stop = [model.stop] if isinstance(model.stop, str) else list(model.stop or [])
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return Request(chat, name, prompt_ids, params, model.stream,
                   bool(model.stream_options and model.stream_options.include_usage), stop, model.return_token_ids,
                   model.n, best_of, rid, int(time.time()), given is not None,
                   f"user:{model.user}" if model.user else rid)


def choice_params(req: Request) -> list[SamplingParams]:
    """The params of each choice the request generates: choice i draws with seed + i (a seeded request's choices
    differ, each reproducible); when best_of > n the choices are ranked by log-probability, so each reports it."""
    rank = req.best_of > req.n and req.params.logprobs is None
    return [dataclasses.replace(req.params, seed=None if req.params.seed is None else req.params.seed + i,
                                logprobs=0 if rank else req.params.logprobs) for i in range(req.best_of)]


def best(generations: list[Generation], n: int) -> list[int]:
    """The indices of the n generations of highest total log-probability (all of them when there are n), best
    first."""
    if len(generations) == n:
        return list(range(n))
    return sorted(range(len(generations)), key=lambda i: -sum(lp.logprob for lp in generations[i].logprobs))[:n]


def _grammar(response_format) -> Grammar | None:
    """response_format -> the grammar the answer is decoded under (None: text); a 400 naming it if invalid."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return JSON_OBJECT
    if response_format.json_schema is None:
        raise APIError(400, "'response_format' of type json_schema needs 'json_schema'", "response_format")
    return Grammar.json_schema(response_format.json_schema.schema_)  # (compiled apart: `compile_grammar`)


def compile_grammar(req: Request, compiler) -> None:
    """Compile the request's grammar (a `GrammarCompiler`: in a child process first, within its time budget) into
    the form its choices copy; a 400 naming `response_format` if it is invalid, too slow or crashes the compiler."""
    if req.params.grammar is None:
        return
    try:
        req.params = dataclasses.replace(req.params, grammar=compiler.compile(req.params.grammar))
    except FlexDraftError as e:
        raise APIError(400, f"'response_format': {e}", "response_format", code="invalid_grammar") from None


def _draft_cap(options) -> int | None:
    """The request's `flexdraft` options -> SamplingParams.max_draft_tokens (0: no speculation; None: no cap)."""
    if options is None:
        return None
    return 0 if not options.speculation else options.num_speculative_tokens


def _completion_prompt(model: CompletionRequest, tokenizer) -> list[int]:
    prompt = model.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise APIError(400, "'prompt' holds several prompts: send one per request", "prompt")
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


def _chat_prompt(model: ChatCompletionRequest, tokenizer) -> list[int]:
    """The conversation through the model's chat template; a `developer` message is the template's `system` one
    (chat templates know system, user and assistant)."""
    clean = [{"role": "system" if m.role == "developer" else m.role,
              "content": m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)}
             for m in model.messages]
    return chat_ids(tokenizer, clean)


class TextStream:
    """Token ids in, text out as it becomes final: a partial UTF-8 character, or the start of a stop string, is
    held back until the next tokens settle it. `stopped` once a stop string appears (the text ends before it).

    Incremental (as vLLM's detokenizer): each call decodes only the tokens since the last settled text plus a
    few before them (so a tokenizer's leading-space rules see their context), not the whole output again."""

    CONTEXT = 5  # tokens decoded before the new ones

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] were decoded last time as context; ids[:read] are text
        self.text = ""  # the text of ids[:read]
        self.sent = 0  # characters handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _settle(self, final: bool) -> None:
        """Append to `text` what the tokens since `read` add, unless it ends in a partial character."""
        if self.read == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = max(len(self.ids) - self.CONTEXT, 0), len(self.ids)
        elif final:
            self.read = len(self.ids)

    def add(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += tokens
        self._settle(final)
        text = self.text
        cut = min((i for i in (text.find(s, max(self.sent - len(s) + 1, 0)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped, end = True, cut
        elif final:
            end = len(text)
        else:
            end = len(text)
            for s in self.stop:  # hold back a suffix that may grow into a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


def finish_reason(generation: Generation | None, stopped: bool) -> str:
    if stopped or (generation is not None and generation.finish_reason == "eos"):
        return "stop"
    return "length"


def usage(req: Request, completion_tokens: int) -> dict:
    n = len(req.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def speculation(generations: list[Generation | None]) -> dict:
    """The FlexDraft extension of a response: over the request's choices, the mean accepted length (tokens per
    target forward after each choice's first token), the target forwards and their share in each decoding mode."""
    done = [g for g in generations if g is not None]
    forwards = sum(g.stats.forwards for g in done)
    if not done:
        return {}
    if len(done) == 1:
        tau, share = done[0].stats.tau, done[0].stats.mode_share
    else:
        tau = sum(len(g.token_ids) - 1 for g in done) / forwards if forwards else 1.0
        share = {}
        for g in done:
            for mode, s in g.stats.mode_share.items():
                share[mode] = share.get(mode, 0.0) + s * g.stats.forwards / forwards
    return {"mean_accepted_length": round(tau, 4), "target_forwards": forwards, "mode_share": share}


def _byte_level() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, SmolLM2's): the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = _byte_level()


class TokenTexts:
    """A token id -> its text and UTF-8 bytes, as OpenAI's logprobs show them (a byte-level token that holds part
    of a character: its bytes exactly, its text with U+FFFD for the partial character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.of = lru_cache(maxsize=1 << 16)(self._of)

    def _of(self, token: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and piece and all(c in BYTE_OF for c in piece):
            raw = bytes(BYTE_OF[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token])
        return text, list(text.encode("utf-8"))


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # (as vLLM: JSON has no -Infinity)


def logprobs_body(req: Request, texts: TokenTexts, logprobs: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` of a choice (or a stream chunk's) for these tokens: chat's `content` list, or the
    completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` (offset: characters before them)."""
    if logprobs is None or req.params.logprobs is None:
        return None
    if req.chat:
        def entry(token, value):
            text, raw = texts.of(token)
            return {"token": text, "logprob": _logprob(value), "bytes": raw}

        return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs], "refusal": None}
    tokens = [texts.of(lp.token)[0] for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{texts.of(t)[0]: _logprob(v) for t, v in (*lp.top, (lp.token, lp.logprob))}
                             for lp in logprobs],
            "text_offset": offsets}


def choice(req: Request, index: int, text: str, token_ids: list[int], generation: Generation | None, stopped: bool,
           logprobs: dict | None = None) -> dict:
    """One choice of a whole response."""
    body = {"index": index, "finish_reason": finish_reason(generation, stopped), "logprobs": logprobs}
    if req.chat:
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["text"] = text
    if req.return_token_ids:
        body["token_ids"] = token_ids
    return body


def response(req: Request, choices: list[dict], completion_tokens: int, generations: list[Generation | None]) -> dict:
    """The whole response: its choices, the usage (completion tokens of every choice generated) and FlexDraft's
    speculation block."""
    return {"id": req.id, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage(req, completion_tokens),
            "flexdraft": speculation(generations)}


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


def chunk(req: Request, text: str | None, token_ids: list[int] | None = None, finish: str | None = None,
          first: bool = False, logprobs: dict | None = None, index: int = 0) -> dict:
    """One stream chunk of new text (text None: the usage-only last chunk has no choices); token_ids and logprobs:
    the tokens since the last chunk."""
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": []}
    if text is not None:
        delta = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if req.chat:
            delta["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        else:
            delta["text"] = text
        if req.return_token_ids:
            delta["token_ids"] = token_ids or []
        body["choices"].append(delta)
    return body


def fit_to_engine(req: Request, engine) -> None:
    """Check the request against the engine's cache (`Engine.check_request`): a prompt that leaves no room is a
    400 on `prompt`, too many new tokens one on `max_tokens`, more choices than the batch has rows one on `n` or
    `best_of`; a default max_tokens shrinks to the room left."""
    if req.best_of > engine.config.max_batch:
        key = "n" if req.best_of == req.n else "best_of"
        raise APIError(400, f"'{key}' asks for {req.best_of} choices; this server decodes at most "
                            f"{engine.config.max_batch} rows at once (engine max_batch)", key)
    need = engine.slots_needed(len(req.prompt_ids), 1)
    if need > engine.config.max_len:
        raise APIError(400, f"the prompt of {len(req.prompt_ids)} tokens leaves no room in the cache of "
                            f"{engine.config.max_len} slots per row ({need - len(req.prompt_ids) - 1} of them are "
                            "verify and branch slots)", "prompt", code="context_length_exceeded")
    if not req.max_tokens_given:
        room = engine.config.max_len - engine.slots_needed(len(req.prompt_ids), 0)
        req.params = dataclasses.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, room))
    try:
        engine.check_request(req.prompt_ids, req.params)
    except ContextTooLong as e:
        raise APIError(400, str(e), "max_tokens", code="context_length_exceeded") from None
    except FieldError as e:
        raise APIError(400, str(e), e.field) from None
    except FlexDraftError as e:
        raise APIError(400, str(e), "prompt") from None
