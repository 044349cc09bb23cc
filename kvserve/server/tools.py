"""Tool calls for /v1/chat/completions: ``tools`` + ``tool_choice``.

- ``none``: tools are not shown to the model; plain text back.
- ``auto``: tools are rendered into the prompt (by the chat template when it takes
  ``tools``, else by kvserve's default, below) and calls are parsed from the output.
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}``
  objects, each a call of one of the tools whose arguments match its schema.
- a named function: the output is constrained to that function's arguments (its schema).

The default rendering, for templates without tool support (SmolLM2's), is the Hermes/Qwen
format many small models are tuned on: the tools' signatures inside ``<tools></tools>`` in
the system message, and each call written as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``. An assistant turn's earlier ``tool_calls`` are written back in that form and
``role: "tool"`` turns are passed to the template as they are.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, ChatTool, FunctionCall, ToolCall
from kvserve.structured import StructuredOutputsParams

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)",
                         re.DOTALL)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

DEFAULT_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[ChatTool] = field(default_factory=list)
    named: Optional[str] = None
    parallel: bool = True

    @property
    def renders_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function.parameters or _EMPTY_PARAMETERS
        raise KeyError(name)

    def spec(self) -> Optional[StructuredOutputsParams]:
        """The grammar that forces a call (required / named), else None. Argument objects are
        closed unless their schema opens them (``strict``): a key outside the schema would
        break the caller's ``fn(**arguments)``."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters(self.named), strict=True)
        if self.mode != "required":
            return None
        variants = [{"type": "object",
                     "properties": {"name": {"const": t.function.name},
                                    "arguments": t.function.parameters or _EMPTY_PARAMETERS},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, strict=True)

    def known(self, name: Any) -> bool:
        return any(t.function.name == name for t in self.tools)


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """Check tools / tool_choice and decide how the request is served (400 on misuse)."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(mode=choice, tools=tools, parallel=parallel)
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not "
                          f"among the tools", param="tool_choice")
    return ToolPlan(mode="named", tools=tools, named=choice.function.name, parallel=parallel)


# ---------------------------------------------------------------------- prompt
def template_takes_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tool_dicts(plan: ToolPlan) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json", exclude_none=True) for t in plan.tools]


def call_text(name: str, arguments: Any) -> str:
    """One call as the default format writes it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def add_default_tool_prompt(conversation: list[dict], plan: ToolPlan) -> list[dict]:
    """The tools' signatures in the system message (a new one first if there is none)."""
    block = DEFAULT_TOOL_PROMPT.format(
        tools="\n".join(json.dumps(d, ensure_ascii=False) for d in tool_dicts(plan)))
    if conversation and conversation[0]["role"] in ("system", "developer"):
        first = dict(conversation[0])
        first["content"] = (first["content"] + "\n\n" + block).strip()
        return [first] + conversation[1:]
    return [{"role": "system", "content": block}] + conversation


def messages_for_template(conversation: list[dict], native_tools: bool) -> list[dict]:
    """Earlier tool calls in the conversation, as the template expects them: structured
    (arguments as objects) for a template that knows tools, else written into the text."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        message = dict(message)
        if native_tools:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": _loads_or_text(c["function"]["arguments"])}}
                for c in calls]
        else:
            del message["tool_calls"]
            text = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                             for c in calls)
            message["content"] = (message.get("content") or "") + ("\n" if message.get("content") else "") + text
        out.append(message)
    return out


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---------------------------------------------------------------------- output
def forced_calls(text: str, plan: ToolPlan, truncated: bool = False) -> Optional[list[ToolCall]]:
    """The calls in a constrained output; None if it is incomplete, unless ``truncated`` (cut
    by max_tokens): then the calls as far as they came, the last one's arguments unfinished
    JSON text, as OpenAI returns a forced call cut short (finish_reason "length")."""
    try:
        value = json.loads(text)
    except ValueError:
        return _calls_so_far(text, plan) if truncated else None
    if plan.mode == "named":
        if not isinstance(value, dict):
            return None
        return [_call(plan.named, value)]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not plan.known(item.get("name")):
            return None
        calls.append(_call(item["name"], item.get("arguments", {})))
    return calls


_PARTIAL_CALL = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*(?:,\s*"arguments"\s*:\s*(.*))?', re.S)
_ITEM_GAP = re.compile(r"\s*,?\s*")


def _calls_so_far(text: str, plan: ToolPlan) -> Optional[list[ToolCall]]:
    """A forced output cut short: a named call's arguments so far; of a required array, its
    whole calls and the last one once its name is complete. None before any name is."""
    if plan.mode == "named":
        return [_call(plan.named, text)]
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return None
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 1
    while True:
        pos = _ITEM_GAP.match(stripped, pos).end()
        try:
            item, end = decoder.raw_decode(stripped, pos)
        except ValueError:
            break
        if not isinstance(item, dict) or not plan.known(item.get("name")):
            return None
        calls.append(_call(item["name"], item.get("arguments", {})))
        pos = end
    last = _PARTIAL_CALL.match(stripped, pos)
    if last is not None and plan.known(last.group(1)):
        calls.append(_call(last.group(1), last.group(2) or ""))
    return calls or None


def parse_auto(text: str, plan: ToolPlan) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a free output: ``<tool_call>`` blocks that hold a known function's
    call become calls; the text around them stays content. A block that does not parse is
    left in the content as written."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL_BLOCK.finditer(text):
        call = _parse_call(match.group(1), plan)
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept) if calls else text
    # Not stripped: the streamed content is a prefix of this text.
    return (content if content.strip() else None), calls


def _parse_call(body: str, plan: ToolPlan) -> Optional[ToolCall]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not plan.known(value.get("name")):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"], arguments)


def _call(name: str, arguments: Any) -> ToolCall:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


class AutoContentFilter:
    """Streaming in ``auto`` mode: content is sent as it comes until a ``<tool_call>`` opens;
    a tail that may be the start of one is held back; the rest waits for the end."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_call = False

    def delta(self, text: str) -> str:
        if self.in_call:
            return ""
        at = text.find(CALL_OPEN, self.sent)
        if at != -1:
            self.in_call = True
            end = at
        else:
            end = len(text)
            for n in range(min(len(CALL_OPEN) - 1, len(text) - self.sent), 0, -1):
                if text.endswith(CALL_OPEN[:n]):
                    end = len(text) - n
                    break
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def rest(self, content: Optional[str]) -> str:
        """What of the final content was not sent yet (content after the calls, or the
        held-back tail)."""
        if content is None:
            return ""
        return content[self.sent:] if len(content) > self.sent else ""
