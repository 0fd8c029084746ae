"""The OpenAI completions and chat-completions protocol over the engine: validated request models
(`serving.protocol`) to engine requests with OpenAI-style errors that name the field, prompts from text, token
ids or chat messages, incremental detokenisation with stop strings, and the response and stream-chunk bodies.
serving/ray_app.py puts them behind FastAPI."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

from flexdraft.core.data import chat_ids
from flexdraft.core.errors import ContextTooLong, FlexDraftError
from flexdraft.serving.protocol import ChatCompletionRequest, CompletionRequest
from flexdraft.speculative.sampling import Generation, SamplingParams

# fields OpenAI defines that FlexDraft does not serve: refused by name unless at their no-op value
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0), "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False), "suffix": lambda v: v is not None,
    "logit_bias": lambda v: bool(v), "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0), "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"), "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
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
    id: str = ""
    created: int = 0
    max_tokens_given: bool = True  # False: the server's default, shortened to the room the cache leaves


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
    prompt_ids = _chat_prompt(model, tokenizer) if chat else _completion_prompt(model, tokenizer)
    try:
        params = SamplingParams(max_new_tokens=given or default_max_tokens,
                                temperature=1.0 if model.temperature is None else float(model.temperature),
                                top_p=1.0 if model.top_p is None else float(model.top_p),
                                top_k=max(model.top_k or 0, 0), seed=model.seed,
                                max_draft_tokens=_draft_cap(model.flexdraft), ignore_eos=model.ignore_eos,
                                stop_token_ids=tuple(model.stop_token_ids or ()))
    except FlexDraftError as e:  # (the schema's bounds are the engine's: this is a second line of defence)
        raise APIError(400, str(e)) from None
    stop = [model.stop] if isinstance(model.stop, str) else list(model.stop or [])
    return Request(chat, name, prompt_ids, params, model.stream,
                   bool(model.stream_options and model.stream_options.include_usage), stop, model.return_token_ids,
                   f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), given is not None)


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


def speculation(generation: Generation | None) -> dict:
    """The FlexDraft extension of a response: the request's mean accepted length (tokens per target forward)
    and the share of its steps in each decoding mode."""
    if generation is None:
        return {}
    stats = generation.stats
    return {"mean_accepted_length": round(stats.tau, 4), "target_forwards": stats.forwards,
            "mode_share": stats.mode_share}


def response(req: Request, text: str, token_ids: list[int], generation: Generation | None, stopped: bool) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason(generation, stopped), "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": req.id, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": req.model, "choices": [choice], "usage": usage(req, len(token_ids)),
            "flexdraft": speculation(generation)}


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


def chunk(req: Request, text: str | None, token_ids: list[int] | None = None, finish: str | None = None,
          first: bool = False) -> dict:
    """One stream chunk of new text (text None: the usage-only last chunk has no choices)."""
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": []}
    if text is not None:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if req.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        else:
            choice["text"] = text
        if req.return_token_ids:
            choice["token_ids"] = token_ids or []
        body["choices"].append(choice)
    return body


def fit_to_engine(req: Request, engine) -> None:
    """Check the request against the engine's cache (`Engine.check_request`): a prompt that leaves no room is a
    400 on `prompt`, too many new tokens one on `max_tokens`; a default max_tokens shrinks to the room left."""
    need = engine.slots_needed(len(req.prompt_ids), 1)
    if need > engine.config.max_len:
        raise APIError(400, f"the prompt of {len(req.prompt_ids)} tokens leaves no room in the cache of "
                            f"{engine.config.max_len} slots per row ({need - len(req.prompt_ids) - 1} of them are "
                            "verify and branch slots)", "prompt", code="context_length_exceeded")
    if not req.max_tokens_given:
        room = engine.config.max_len - engine.slots_needed(len(req.prompt_ids), 0)
        req.params.max_new_tokens = min(req.params.max_new_tokens, room)
    try:
        engine.check_request(req.prompt_ids, req.params)
    except ContextTooLong as e:
        raise APIError(400, str(e), "max_tokens", code="context_length_exceeded") from None
    except FlexDraftError as e:
        raise APIError(400, str(e), "prompt") from None
