"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in this
server's memory only, the most recently used ``capacity`` of them (an LRU), so that a
long-running server's memory stays bounded. A restarted server, or a response pushed out by
newer ones, is "not found": the client sends the conversation itself then."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_CAPACITY = 1024


@dataclass
class StoredResponse:
    # The conversation so far as chat turns (role/content/tool_calls dicts), this response's
    # output included and its ``instructions`` not (OpenAI does not carry those over).
    conversation: list[dict[str, Any]]
    response: dict[str, Any]  # the response object as it was returned


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("the response store needs room for at least one response")
        self.capacity = capacity
        self._items: "OrderedDict[str, StoredResponse]" = OrderedDict()
        self._lock = threading.Lock()  # (handlers run on the event loop; tests read from others)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def __len__(self) -> int:
        return len(self._items)
