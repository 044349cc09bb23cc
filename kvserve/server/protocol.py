"""Pydantic schemas of the OpenAI-compatible API: field names and shapes as OpenAI's, plus
kvserve's extra sampling fields (top_k, min_p, repetition_penalty, ...)."""
from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from kvserve.request import SamplingParams

# OpenAI's own limits for these.
MAX_N = 128
MAX_LOGPROBS = 20

# Token ids: integers, never booleans; the upper bound (the vocabulary) is added to the
# served spec by the app, which knows the model.
def _integral(value: Any) -> Any:
    # JSON Schema's "integer" includes 2.0 (booleans stay refused: they are not numbers).
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Pydantic writes a validated type's bounds as raw ge/le keys; the app's served_spec turns
# them into JSON Schema's minimum/maximum.
Integer = Annotated[int, BeforeValidator(_integral)]
TOKEN_ID_MARK = "x-kvserve-token-id"
TOKEN_KEY_MARK = "x-kvserve-token-key"  # a token id written as an object key (logit_bias)
# A generation length: below the context (max_model_len - 1 with a one-token prompt; the
# server refuses more, and what the prompt leaves, which no schema can state).
MAX_TOKENS_MARK = "x-kvserve-max-tokens"
TokenId = Annotated[int, BeforeValidator(_integral), Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
PromptInput = Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds,
                    Annotated[list[TokenIds], Field(min_length=1)]]


_TOKEN_KEY = r"^(0|[1-9][0-9]{0,9})$"
# Pydantic writes constrained dict keys as patternProperties, which leaves other keys allowed:
# the spec states propertyNames instead.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=_TOKEN_KEY)], Annotated[float, Field(ge=-100.0, le=100.0)]],
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": _TOKEN_KEY, TOKEN_KEY_MARK: True},
                    "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0}})]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class RequestModel(BaseModel):
    """A request body part: validated strictly, so the server accepts what the OpenAPI spec
    says and nothing else (no ``true`` for an integer, no ``1`` for a string), and no field it
    does not know: a parameter the server does not implement (``best_of``, vLLM's older
    ``guided_json``) is refused with its name, never dropped. Chat messages and their content
    parts keep unknown keys (clients send back response messages whole: ``refusal``,
    ``annotations``); those are content, not parameters."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute; the alias keeps the wire name.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None

    model_config = ConfigDict(populate_by_name=True, strict=True)


class ResponseFormat(RequestModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema (the
    json_schema type needs its json_schema object, as the spec says)."""

    model_config = ConfigDict(strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's structured_outputs: exactly one of the constraint fields."""

    json_: Union[dict[str, Any], str] = Field(None, alias="json")
    regex: str = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] = Field(None, min_length=1)
    grammar: str = Field(None, min_length=1)
    json_object: Literal[True] = None

    model_config = ConfigDict(populate_by_name=True, strict=True, json_schema_extra={
        "oneOf": [{"required": [name]} for name in ("json", "regex", "choice", "grammar",
                                                     "json_object")]})


# One output constraint at a time: a JSON response_format and structured_outputs together
# are refused, and the spec says so.
ONE_CONSTRAINT = {"not": {
    "required": ["response_format", "structured_outputs"],
    "properties": {"response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["json_object", "json_schema"]}}},
        "structured_outputs": {"type": "object"}}}}


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions. ``None`` means "default";
    OpenAI clients send explicit nulls."""

    model_config = ConfigDict(strict=True, json_schema_extra={"allOf": [ONE_CONSTRAINT]})

    model: Optional[str] = None
    n: Optional[Integer] = Field(None, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    max_tokens: Optional[Integer] = Field(None, ge=1, json_schema_extra={MAX_TOKENS_MARK: True})
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Integer] = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # Token id (decimal, as OpenAI's) -> bias in [-100, 100]; the spec says both, so a client
    # generated from it cannot send a key or value the server refuses.
    logit_bias: Optional[LogitBias] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # kvserve / vLLM extras
    top_k: Optional[Integer] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    # At most max_tokens in effect: a min_tokens above it (above the default max_tokens, say)
    # is cut to it rather than refused, since no schema can compare the two fields.
    min_tokens: Optional[Integer] = Field(None, ge=0)
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # Prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} to a prefill
    # instance; its answer's kv_transfer_params, unchanged, to the decode instance.
    kv_transfer_params: Optional[dict[str, Any]] = None

    def base_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """SamplingParams for this request; raises ValueError naming a bad logit_bias key."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = float(value)
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        stop = self.stop if isinstance(self.stop, list) else ([self.stop] if self.stop else [])

        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=pick(self.n, 1), temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0), logit_bias=bias, seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=min(pick(self.min_tokens, 0), max_tokens if max_tokens is not None else 1 << 62),
            ignore_eos=bool(self.ignore_eos), stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output), logprobs=logprobs,
            skip_special_tokens=pick(self.skip_special_tokens, True),
            kv_transfer_params=self.kv_transfer_params)

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    echo: Optional[bool] = False
    logprobs: Optional[Integer] = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's insertion suffix is not supported: the spec allows it only empty (or null),
    # so clients generated from the spec do not send what the server would refuse.
    suffix: Optional[Annotated[str, Field(max_length=0)]] = None
    # Every sample generated is returned: best_of only as n (a client sending best_of: 1 with
    # the default n keeps working).
    best_of: Optional[Integer] = Field(None, ge=1, le=MAX_N)

    # OpenAI's default for the legacy completions endpoint.
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.base_sampling_params(max_tokens, self.logprobs)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; absent: no arguments
    strict: Optional[bool] = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# In an assistant message sent back: what else clients copy from a response is content, not
# parameters (openai-python's parse helper adds function.parsed_arguments, its stream helper
# each call's index).
class FunctionCall(RequestModel, extra="allow"):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(RequestModel, extra="allow"):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(RequestModel, extra="allow"):
    type: Literal["text"]  # the only kind these text models take
    text: str


class ChatMessage(RequestModel, extra="allow"):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a "tool" turn: the result of that call


class ChatCompletionRequest(SamplingRequest):
    # What the server refuses, the spec says: top_logprobs needs logprobs: true, and a
    # tool_choice other than "none" needs tools.
    model_config = ConfigDict(strict=True, json_schema_extra={"allOf": [
        {"if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
         "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
        {"if": {"properties": {"tool_choice": {"not": {"enum": ["none", None]}}},
                "required": ["tool_choice"]},
         "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}},
        ONE_CONSTRAINT,
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Integer] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[Integer] = Field(None, ge=1, json_schema_extra={MAX_TOKENS_MARK: True})
    add_generation_prompt: Optional[bool] = True
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True

    def to_sampling_params(self) -> SamplingParams:
        # None: generate up to the context, as OpenAI's chat endpoint does.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.base_sampling_params(max_tokens, logprobs)


class TokenizeRequest(RequestModel):
    """Exactly one of prompt and messages."""

    model_config = ConfigDict(strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: Optional[str] = None
    prompt: str = None
    messages: list[ChatMessage] = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# OpenAI's limit on inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(RequestModel):
    """/v1/embeddings: one input or a batch, as text or token ids (OpenAI's shapes)."""

    model: Optional[str] = None
    input: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)],
                 TokenIds, Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]]
    # The openai client asks for base64 unless told otherwise (little-endian float32 bytes).
    encoding_format: Optional[Literal["float", "base64"]] = "float"
    # Only the model's own width: the vectors are pooled hidden states, not truncatable
    # Matryoshka embeddings (any other value is a 400 naming the width).
    dimensions: Optional[Integer] = Field(None, ge=1)
    user: Optional[str] = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------------- responses
class KVTransferRelease(RequestModel):
    transfer_id: str


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    # A prefill instance's answer to do_remote_decode: what its decode instance continues from.
    kv_transfer_params: Optional[dict[str, Any]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None
    # A prefill instance's answer to do_remote_decode: what its decode instance continues from.
    kv_transfer_params: Optional[dict[str, Any]] = None


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    max_model_len: Optional[int] = None
    # False: the model has no chat template, so /v1/chat/completions answers 400 (the server
    # takes one with --chat-template).
    chat_template: bool = True


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
