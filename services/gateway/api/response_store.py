"""Where `/v1/responses` keeps its response objects (services/gateway/api/responses.py): a small interface,
ResponseStore, and the in-memory store behind it. A durable store (SQLite, so a restarted gateway still answers
`GET /v1/responses/{id}` and `previous_response_id`) implements the same three calls.

A StoredResponse is what a later request may ask of a response: the request as it echoes in the response object,
the conversation it answered (for `previous_response_id`), and either its running request's handle (whose event
log the response object and its stream are made from) or, once settled, the final response object and the
assistant messages it added. The events themselves are the request's log (services/gateway/frontend/events.py), kept as
long as the gateway keeps ended requests' logs; a settled record outlives them."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.frontend.events import RequestHandle
from services.gateway.frontend.schemas import cache_tenant


@dataclass(eq=False)
class StoredResponse:
    """One stored response. `handle` is set while its request runs and until it is settled (responses_api.settle
    turns the ended log into `final` and `output_messages`, and lets the handle go)."""

    id: str  # "resp_" + its request's id
    created_at: int
    echo: dict  # the request's fields as the response object shows them (model, instructions, tools, text, ...)
    messages: list[dict]  # the conversation it answered, as chat messages, without its instructions
    background: bool = False
    handle: RequestHandle | None = None
    final: dict | None = None  # the response object once its request ended
    output_messages: list[dict] = field(default_factory=list)  # what it added to the conversation (assistant turns)
    ended_at: float | None = None  # time.monotonic() when its request ended (set when settled)

    @property
    def request_id(self) -> str:
        return self.id.removeprefix("resp_")

    @property
    def tenant(self) -> str:
        """Whose it is: its request's tenant (schemas.cache_tenant of its `user` / `prompt_cache_key`, which the
        echo keeps, across a gateway restart too); "" for a request that named neither (anyone's)."""
        return cache_tenant(self.echo)

    @property
    def ended(self) -> bool:
        return self.final is not None or (self.handle is not None and self.handle.log.ended)

    def end_time(self) -> float | None:
        """When its request ended (time.monotonic()), settled or not; None while it runs."""
        if self.ended_at is not None:
            return self.ended_at
        return self.handle.ended_at if self.handle is not None and self.handle.log.ended else None


class ResponseStore(Protocol):
    """The stored responses by id. `save` inserts or replaces (a durable store writes the record again when it is
    settled); `get` answers None for an id never stored, deleted or expired; `delete` says whether it held it."""

    def save(self, record: StoredResponse) -> None: ...

    def get(self, response_id: str) -> StoredResponse | None: ...

    def delete(self, response_id: str) -> bool: ...


class MemoryResponseStore:
    """A ResponseStore in this process's memory, gone when it stops. It holds every running response, and of the
    ended ones at most `max_count` in all, none longer than `ttl_s` after its end: the oldest ended go first."""

    def __init__(self, max_count: int, ttl_s: float):  # the gateway's --stored-responses, --stored-responses-ttl
        self.max_count, self.ttl_s = max_count, ttl_s
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest created first

    def __len__(self) -> int:
        return len(self._records)

    def save(self, record: StoredResponse) -> None:
        self._records[record.id] = record
        self._forget_old()

    def get(self, response_id: str) -> StoredResponse | None:
        self._forget_old()
        return self._records.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    def _forget_old(self) -> None:
        now = time.monotonic()
        ended = [(r.end_time(), r.id) for r in self._records.values() if r.end_time() is not None]
        for end, rid in ended:
            if now - end > self.ttl_s:
                del self._records[rid]
        excess = len(self._records) - self.max_count
        for _, rid in sorted((e for e in ended if e[1] in self._records), key=lambda e: e[0])[:max(0, excess)]:
            del self._records[rid]
