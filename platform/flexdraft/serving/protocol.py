"""The OpenAI request schemas FlexDraft serves, as pydantic models (the shape of vLLM's `protocol.py`): FastAPI
validates request bodies with them and publishes them at /openapi.json. Every field is bounded by what the
engine and torch beneath accept, not only by its JSON type (a seed torch cannot take, a NaN temperature, a
string that is not Unicode text are refused here), and no type is coerced (`"10"` is not 10, `true` is not 1).
Fields OpenAI defines that FlexDraft does not serve are accepted only at their no-op values (`openai_api`)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flexdraft.speculative.sampling import SEED_RANGE

MAX_TEXT_CHARS = 1_000_000  # a prompt or message (the body limit bounds the whole request too)
MAX_PROMPT_TOKENS = 1 << 20  # a token-id prompt; the engine's cache bounds it again per deployment
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096


def _unicode(text: str) -> str:
    """Valid Unicode only: JSON can carry lone surrogates (\\ud800) that no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_unicode)]
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2 ** 31)]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculationOptions(_Strict):
    """FlexDraft extension, per request (`"flexdraft": {...}`; the OpenAI client's `extra_body`): what this
    request's decoding may speculate. The output is the same either way; only its speed differs."""
    speculation: bool = Field(True, description="false: this request takes AR steps only (its batch may speculate)")
    num_speculative_tokens: Annotated[int, Field(ge=0, le=64)] | None = Field(
        None, description="the most drafts verified per step for this request (0: none; default: the engine's)")


class _Sampling(_Strict):
    """What completions and chat completions share."""
    model: Annotated[str, Field(max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None  # < 1e-5: greedy
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2 ** 31 - 1)] | None = None  # -1 and 0: off
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    return_token_ids: bool = Field(False, description="FlexDraft extension: the generated token ids per choice")
    ignore_eos: bool = Field(False, description="vLLM extension: the model's end-of-sequence token does not end the "
                                                "answer (it runs to max_tokens; benchmark clients send it)")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2 ** 31)]], Field(max_length=64)] | None = Field(
        None, description="vLLM extension: more token ids that end the answer (the id stays in token_ids)")
    flexdraft: SpeculationOptions | None = None
    # OpenAI fields FlexDraft does not serve: refused unless at their no-op value (openai_api.UNSUPPORTED)
    n: int | None = None
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: text, token ids, or a batch of exactly one of either."""
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=64)]
    echo: bool | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: Text | Annotated[list[TextPart], Field(max_length=1024)]
    name: Annotated[str, Field(max_length=256)] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's metadata that SDKs and agent frameworks send: accepted and ignored (as vLLM does); the output is the
    # same with or without them
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
