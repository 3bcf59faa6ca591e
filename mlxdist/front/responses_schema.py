"""The request body of OpenAI's Responses API (``POST /v1/responses``) as
pydantic models: what the front reads, checked by type and bound.

Read: input (a string or items), instructions, tools (function tools),
tool_choice, parallel_tool_calls, max_output_tokens, temperature, top_p,
previous_response_id, store, stream, metadata. The ``openai`` client's other
fields (``IGNORED``: reasoning, include, prompt_cache_key, text, truncation,
service_tier...) are accepted and have no effect; those that would change
the answer in a way this server cannot give (``background``, a stored
``prompt`` or a ``conversation``) are refused when set. Input items are
told apart by ``type``: messages, ``function_call``,
``function_call_output`` and (ignored) ``reasoning``; any other is a 400
naming it.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlxdist.front.messages_schema import MAX_MESSAGES, MAX_NAME_CHARS, MAX_TOOLS, first_error

MAX_ID_CHARS = 256

IGNORED = (
    "access_programs", "background_options", "context_management", "image", "include", "max_tool_calls",
    "moderation", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning",
    "safety_identifier", "service_tier", "stream_options", "text", "top_logprobs", "truncation", "user",
    "cyber",
)
REFUSED = ("background", "conversation", "prompt")  # when set: answers this server cannot give


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: Optional[str] = None
    refusal: Optional[str] = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, List[Dict[str, Any]]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: Union[str, List[Dict[str, Any]]]


class ReasoningItem(_Item):
    """The model's earlier reasoning handed back: not shown to it again."""

    type: Literal["reasoning"]


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}
ITEM_TYPES = tuple(ITEMS)
PART_TYPES = ("input_text", "output_text", "text", "refusal")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    input: Union[str, List[Dict[str, Any]], None] = None
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "none", "required"], Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    previous_response_id: Optional[str] = Field(default=None, max_length=MAX_ID_CHARS)
    store: Optional[bool] = None
    stream: Optional[bool] = None
    metadata: Optional[Dict[str, str]] = Field(default=None, max_length=16)

    def refused_field(self) -> Optional[str]:
        """Why a field sent is refused (one neither read nor in ``IGNORED``, or a ``REFUSED`` one set), or None."""
        extra = self.model_extra or {}
        for name in REFUSED:
            if extra.get(name) not in (None, False):
                return f"{name} is not served here: an answer is given to the request, from the input it carries"
        unknown = sorted(set(extra) - set(IGNORED) - set(REFUSED))
        return f"{unknown[0][:60]}: unknown field" if unknown else None

    def items(self) -> List[Any]:
        """``input`` as items (a string is one user message); a ValueError names an item this server cannot read."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if len(self.input) > MAX_MESSAGES:
            raise ValueError(f"input: at most {MAX_MESSAGES} items")
        items = []
        for i, raw in enumerate(self.input):
            kind = raw.get("type", "message")
            if kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: an item of type {str(kind)[:40]!r} is not read here "
                                 f"(known: {', '.join(ITEM_TYPES)})")
            try:
                items.append(ITEMS[kind].model_validate({**raw, "type": kind}))
            except ValidationError as e:
                raise ValueError(first_error(e, f"input[{i}]")) from None
        return items

    def function_tools(self) -> List[FunctionTool]:
        """The function tools; any other type (web search, file search, computer use) is a ValueError:
        nothing here runs it."""
        out = []
        for i, raw in enumerate(self.tools or ()):
            if raw.get("type") != "function":
                raise ValueError(f"tools[{i}]: a tool of type {str(raw.get('type'))[:60]!r} is not run here; "
                                 f"this server takes function tools (the client runs them)")
            try:
                out.append(FunctionTool.model_validate(raw))
            except ValidationError as e:
                raise ValueError(first_error(e, f"tools[{i}]")) from None
        return out


def part_text(content: Union[str, List[Dict[str, Any]]], where: str) -> str:
    """A message's (or a tool output's) text; a part that is not text (an image, a file) is a ValueError."""
    if isinstance(content, str):
        return content
    text = []
    for i, raw in enumerate(content):
        kind = raw.get("type")
        if kind not in PART_TYPES:
            raise ValueError(f"{where}.content[{i}]: a part of type {str(kind)[:40]!r} is not read here "
                             f"(this server's model reads text only)")
        try:
            part = ContentPart.model_validate(raw)
        except ValidationError as e:
            raise ValueError(first_error(e, f"{where}.content[{i}]")) from None
        value = part.refusal if kind == "refusal" else part.text
        if not isinstance(value, str):
            raise ValueError(f"{where}.content[{i}]: a {kind} part needs its text")
        text.append(value)
    return "".join(text)

