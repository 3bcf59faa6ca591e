"""The request body of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``) as pydantic models: what the front reads,
checked by type and bound before anything reaches the rank server.

Every top-level field the ``anthropic`` client can send is known: those that
mean something here are read (system, messages, tools, tool_choice,
stop_sequences, max_tokens, temperature, top_p, top_k, thinking, stream,
metadata); the rest (``IGNORED``: service_tier, container, betas...) are
accepted and have no effect. A field no client sends is refused, as the
rank server refuses one. Blocks are told apart by ``type``; a type this
server cannot read (an image, a document, a server tool's result) is a 400
naming it.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import Annotated

MAX_MESSAGES = 512  # as the rank server's RequestLimits
MAX_TOOLS = 128
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256

# Fields the anthropic client (messages and beta.messages) sends that do not
# apply to a model served here: accepted, no effect.
IGNORED = (
    "cache_control", "container", "context_management", "diagnostics", "inference_geo", "mcp_servers",
    "output_config", "service_tier", "speed", "user_profile_id", "workspace_id", "betas", "billing_policy",
    "compaction", "fallback_credit_token", "fallbacks", "thread", "output_format",
)


class _Block(BaseModel):
    """A content block: its own extra fields (cache_control, citations) are accepted and not read."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: Dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    content: Union[str, List[TextBlock], None] = None
    is_error: Optional[bool] = None


class ThinkingBlock(_Block):
    """A thinking block handed back: the model's own earlier reasoning, not shown to it again."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]
BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
          "redacted_thinking": RedactedThinkingBlock}
BLOCK_TYPES = tuple(BLOCKS)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Dict[str, Any]]]  # blocks read by type in translate.py, for a one-line refusal


class Tool(BaseModel):
    """A tool the model may call (a "custom" tool: the client runs it)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: Optional[str] = None
    input_schema: Dict[str, Any]
    type: Optional[Literal["custom"]] = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    user_id: Optional[str] = None


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: what the prompt is made of. Extra
    fields are kept aside for ``refused_field`` (``IGNORED`` pass)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(max_length=MAX_NAME_CHARS)
    messages: List[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Union[str, List[TextBlock], None] = None
    tools: Optional[List[Dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)  # read as Tool, by type
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None

    def refused_field(self) -> Optional[str]:
        """Why a field sent is refused (the first neither read nor in ``IGNORED``), or None."""
        unknown = sorted(set(self.model_extra or ()) - set(IGNORED))
        return f"{unknown[0][:60]}: unknown field" if unknown else None


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``: the prompt, and how to answer it."""

    max_tokens: int = Field(ge=0)  # 0: read the prompt (warm the cache), answer nothing
    stop_sequences: Optional[List[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]]] = Field(
        default=None, max_length=MAX_STOP)
    stream: Optional[bool] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[Metadata] = None


def parse_blocks(content: Union[str, List[Dict[str, Any]]], where: str) -> List[Block]:
    """A message's content as blocks (a string is one text block); an
    unknown block type is a ``ValueError`` naming it and where it is."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    blocks = []
    for i, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in BLOCK_TYPES:
            raise ValueError(f"{where}.content[{i}]: a block of type {str(kind)[:40]!r} is not read here "
                             f"(known: {', '.join(BLOCK_TYPES)}; this server's model reads text only)")
        inner = raw.get("content") if kind == "tool_result" else None
        for j, part in enumerate(inner if isinstance(inner, list) else ()):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind != "text":
                raise ValueError(f"{where}.content[{i}].content[{j}]: a tool result's block of type "
                                 f"{str(part_kind)[:40]!r} is not read here (this server's model reads text only)")
        try:
            blocks.append(BLOCKS[kind].model_validate(raw))
        except ValidationError as e:
            raise ValueError(first_error(e, f"{where}.content[{i}]")) from None
    return blocks


def first_error(error: Any, prefix: str = "") -> str:
    """A pydantic ``ValidationError`` as one line: where the first problem is, and what it is."""
    first = error.errors()[0]
    where = prefix
    for part in first["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif not str(part).startswith(("function-", "tagged-union", "union[", "str", "list[", "dict[", "literal[",
                                        "nullable", "json-or-python", "is-instance")):
            where += f".{part}" if where else str(part)
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "missing":
        message = "required"
    return f"{where}: {message}" if where else message

