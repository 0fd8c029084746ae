"""The OpenAI request schemas FlexDraft serves, as pydantic models (the shape of vLLM's `protocol.py`): FastAPI
validates request bodies with them and publishes them at /openapi.json. Every field is bounded by what the
engine and torch beneath accept, not only by its JSON type (a seed torch cannot take, a NaN temperature, a
string that is not Unicode text are refused here), and no type is coerced (`"10"` is not 10, `true` is not 1).
Fields OpenAI defines that FlexDraft does not serve are accepted only at their no-op values (`openai_api`)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flexdraft.speculative.sampling import MAX_LOGPROBS, REPETITION_PENALTY_RANGE, SEED_RANGE

MAX_TEXT_CHARS = 1_000_000  # a prompt or message (the body limit bounds the whole request too)
MAX_PROMPT_TOKENS = 1 << 20  # a token-id prompt; the engine's cache bounds it again per deployment
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_CHOICES = 16  # n, best_of: the choices of one request are rows of the engine's batch


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
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # logit_bias keys: token ids as JSON object keys


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="the JSON schema the answer must validate against")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON valid against a schema. The answer is decoded
    under the grammar (drafts and verification masked by it), so it parses whatever the model would say."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


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
    # the target's distribution as the request asks (each draft is verified against exactly it)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                               allow_inf_nan=False)] | None = Field(
        None, description="vLLM extension: a prompt or output token's logit divided by this (times, if negative)")
    logit_bias: Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                          Field(max_length=300)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=1 << 20)] = Field(
        0, description="vLLM extension: no end-of-sequence or stop token before this many tokens")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = Field(
        1, description="choices to generate; they share the prompt's prefill and decode as rows of one batch")
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: text, token ids, or a batch of exactly one of either."""
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=64)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="each token's log-probability and this many most likely alternatives")
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description="generate this many choices and return the n of highest log-probability (not streamed)")
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
    logprobs: bool = Field(False, description="each token's log-probability (and top_logprobs alternatives)")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="with logprobs: this many most likely alternatives per token")
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
