"""Pydantic schemas of /v1/responses (OpenAI's Responses API), the subset kvserve serves:
text input or a list of input items (messages, function calls and their outputs), function
tools, ``text.format`` (text, json_object, json_schema), sampling and length limits, and
``previous_response_id``. Field names and shapes as OpenAI's; output objects are built as
plain dicts in server/responses.py, in the shapes the openai client parses."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from kvserve.server.protocol import (MAX_TOKENS_MARK, FunctionDefinition, Integer, JsonSchemaFormat,
                                     RequestModel, Text)


# Input items keep unknown keys, as chat messages do: clients send earlier output items back
# whole (``id``, ``status``, ``annotations``, ``logprobs``); those are content, not parameters.
class InputTextPart(RequestModel, extra="allow"):
    # output_text: an assistant message sent back from an earlier response.
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestModel, extra="allow"):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputTextPart]]


class FunctionCallItem(RequestModel, extra="allow"):
    """A call the model made (an earlier output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(RequestModel, extra="allow"):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[InputTextPart]]


def _item_kind(value: Any) -> Optional[str]:
    # A message may leave its type out (the "easy" input message); others must name theirs.
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_kind)]


class FunctionTool(FunctionDefinition):
    """A function tool, flat as the Responses API writes it (chat nests it in ``function``)."""

    type: Literal["function"]


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """``text.format``: free text, any JSON object, or JSON matching ``schema`` (json_schema
    needs its name and schema, as OpenAI's spec says)."""

    model_config = ConfigDict(populate_by_name=True, strict=True, extra="forbid", json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["name", "schema"]}})

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, min_length=1, max_length=64)
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")


class TextConfig(RequestModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None  # the one level a plain model has


class ResponsesRequest(RequestModel):
    model: Optional[str] = None
    input: Union[Text, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Integer] = Field(None, ge=1, json_schema_extra={MAX_TOKENS_MARK: True})
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: Optional[bool] = False
    text: Optional[TextConfig] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True
    previous_response_id: Optional[str] = None
    # Kept in the server's memory (a bounded LRU: server/response_store.py) unless false.
    store: Optional[bool] = True
    metadata: Optional[dict[str, Annotated[str, Field(max_length=512)]]] = Field(None, max_length=16)
    user: Optional[str] = None
    # Not OpenAI's, but vLLM's and kvserve's chat: a sampled response made repeatable.
    seed: Optional[Integer] = Field(None, ge=-(2**63), lt=2**63)
