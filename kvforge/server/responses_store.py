"""Stored responses of ``POST /v1/responses`` (``--responses-store-size N``): the last N responses whose
request did not say ``store: false``, each with the conversation that led to it, its own output included,
so a request naming it as ``previous_response_id`` continues that conversation. Kept in memory, least
recently stored or read first out; ``GET /v1/responses/{id}`` returns one, ``GET
/v1/responses/{id}/input_items`` its request's input items, and ``DELETE`` drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was sent
    history: tuple[dict, ...]  # chat messages: the conversation without instructions, the response's output last
    input_items: tuple[dict, ...] = ()  # the request's own input, as GET .../input_items lists it


class ResponsesStore:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a responses store holds at least one response, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, history: list[dict], input_items: list[dict] = ()) -> None:
        self._responses[response["id"]] = StoredResponse(response, tuple(history), tuple(input_items))
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
