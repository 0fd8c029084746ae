"""The OpenAI completions and chat-completions protocol over the engine: request validation with OpenAI-style
errors that name the field, prompts from text, token ids or chat messages, incremental text with stop strings,
and the response and stream-chunk bodies. Plain functions of dicts; serve/app.py puts them behind FastAPI."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from flexdraft.data import chat_ids
from flexdraft.errors import FlexDraftError
from flexdraft.generate import Generation, SamplingParams

# fields OpenAI defines that FlexDraft does not serve: refused by name rather than silently ignored
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
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "seed", "stop", "stream", "stream_options", "user", "return_token_ids", *UNSUPPORTED}
ROLES = ("system", "user", "assistant")


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


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not lo <= value <= hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def parse_request(body, chat: bool, served_model: str, tokenizer, max_tokens_limit: int,
                  default_max_tokens: int) -> Request:
    """The JSON body of POST /v1/completions (chat False) or /v1/chat/completions -> Request; APIError naming the
    field otherwise. max_tokens_limit: the most new tokens one request may ask for."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, refused in UNSUPPORTED.items():
        if key in body and refused(body[key]):
            raise APIError(400, f"'{key}' is not supported by this server", key, code="unsupported_parameter")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise APIError(400, f"unknown field '{unknown[0]}'", unknown[0])
    model = body.get("model", served_model)
    if model != served_model:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served_model}'", "model",
                       code="model_not_found")
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body, key, default_max_tokens, 1, max_tokens_limit, integer=True)
    top_k = _number(body, "top_k", 0, -1, 10 ** 9, integer=True)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", "seed")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                            top_p=float(_number(body, "top_p", 1.0, 1e-9, 1)), top_k=max(top_k, 0), seed=seed)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, "'stream_options' takes only include_usage", "stream_options")
    if options and not stream:
        raise APIError(400, "'stream_options' is only allowed with stream: true", "stream_options")
    return Request(chat, model, prompt_ids, params, stream, bool(options.get("include_usage")), stop,
                   bool(body.get("return_token_ids", False)),
                   f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), body.get(key) is not None)


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "'prompt' holds several prompts: send one per request", "prompt")
    raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] needs a 'role' among {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        clean.append({"role": m["role"], "content": content})
    return chat_ids(tokenizer, clean)


class TextStream:
    """Token ids in, text out as it becomes final: a partial UTF-8 character, or the start of a stop string, is
    held back until the next tokens settle it. `stopped` once a stop string appears (the text ends before it)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(self.sent - len(s) + 1, 0)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped, end = True, cut
        elif final:
            end = len(text)
        else:
            end = len(text) - 1 if text.endswith("\ufffd") else len(text)
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
    extra = generation.extra
    return {"mean_accepted_length": round(extra.get("tau", 1.0), 4), "target_forwards": extra.get("forwards", 0),
            "mode_share": extra.get("mode_share", {})}


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
    except FlexDraftError as e:
        too_long = "exceeds" in str(e)
        raise APIError(400, str(e), "max_tokens" if too_long else "prompt",
                       code="context_length_exceeded" if too_long else None) from None
