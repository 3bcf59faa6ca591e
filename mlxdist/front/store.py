"""The responses the front keeps for ``previous_response_id``: each one's
conversation as chat messages (input and answer, not its instructions), the
least recently used dropped past ``--responses-store`` responses or past a
bound on the characters they hold together.

    store = ResponseStore(1000)
    store.put("resp_...", messages)      # a response made with store: true
    store.get("resp_...")                # its messages, or None (never stored, or dropped)

Conversations that continue one another share their message objects (a
list of references each), so a long chain costs its text once; the
character bound counts each conversation whole, erring towards dropping.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

DEFAULT_RESPONSES = 1000
MAX_RESPONSES = 1_000_000  # --responses-store's bound (the characters' bound holds the memory whatever it is)
DEFAULT_MAX_CHARS = 256 << 20  # characters of all kept conversations, each counted whole


def conversation_chars(messages: List[Dict[str, Any]]) -> int:
    """The characters of a conversation's text and tool calls."""
    chars = 0
    for message in messages:
        chars += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            chars += len(call["function"]["arguments"]) + len(call["function"]["name"])
    return chars


class ResponseStore:
    """At most ``capacity`` conversations (0: none kept) and ``max_chars`` characters, least recently used out first."""

    def __init__(self, capacity: int = DEFAULT_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS):
        if capacity < 0 or max_chars < 0:
            raise ValueError("a response store holds zero or more responses")
        self.capacity = capacity
        self.max_chars = max_chars
        self.chars = 0
        self._kept: "OrderedDict[str, Tuple[List[Dict[str, Any]], int]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> Optional[List[Dict[str, Any]]]:
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        self._kept.move_to_end(response_id)
        return list(kept[0])

    def put(self, response_id: str, messages: List[Dict[str, Any]]) -> None:
        chars = conversation_chars(messages)
        if self.capacity == 0 or chars > self.max_chars:
            return
        if response_id in self._kept:
            self.chars -= self._kept.pop(response_id)[1]
        self._kept[response_id] = (list(messages), chars)
        self.chars += chars
        while len(self._kept) > self.capacity or self.chars > self.max_chars:
            _, (_, dropped) = self._kept.popitem(last=False)
            self.chars -= dropped
