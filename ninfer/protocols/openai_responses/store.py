"""The local Responses store: terminal Response objects and their conversation context, bounded LRU.

A stored Response keeps its terminal wire object and a :class:`ContextSegment`: the canonical Items this request
added to the conversation (its normalized input Items, then its output Items), linked to the parent's segment.
``previous_response_id`` replays the whole chain. Segments are shared between a parent and its children, so a
long chain costs its Items once; a segment stays alive while any retained Response's chain reaches it, which is
why deleting or evicting a parent never breaks a retained child.

The byte budget counts every retained Response's envelope plus each distinct live segment once. A Response whose
envelope and whole chain alone exceed the budget fails with ``response_store_capacity_exceeded``; otherwise the
least recently used Responses are evicted until both the record and the byte limits hold.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Mapping

import attrs

from ninfer.core.errors import NinferError, quoted
from ninfer.server.http import json_bytes


class ResponseNotFoundError(NinferError):
    status = 404
    error_type = "invalid_request_error"
    code = "response_not_found"


class StoreCapacityError(NinferError):
    status = 400
    error_type = "invalid_request_error"
    code = "response_store_capacity_exceeded"


def items_size(items: tuple[Mapping[str, Any], ...]) -> int:
    """The accounted size of canonical Items: their compact JSON bytes."""
    return sum(len(json_bytes(item)) for item in items)


@attrs.define(eq=False)
class ContextSegment:
    """One request's contribution to a conversation: ``input_count`` input Items followed by its output Items."""

    parent: ContextSegment | None
    items: tuple[Mapping[str, Any], ...]
    input_count: int
    size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.size = items_size(self.items)

    @property
    def input_items(self) -> tuple[Mapping[str, Any], ...]:
        return self.items[: self.input_count]

    def chain(self) -> Iterator[ContextSegment]:
        """This segment and its ancestors, newest first."""
        segment: ContextSegment | None = self
        while segment is not None:
            yield segment
            segment = segment.parent

    def history(self) -> tuple[Mapping[str, Any], ...]:
        """Every Item of the chain, oldest first."""
        return tuple(item for segment in reversed(list(self.chain())) for item in segment.items)

    def output_starts(self) -> frozenset[int]:
        """The :meth:`history` indices where each segment's output Items begin."""
        starts, offset = set(), 0
        for segment in reversed(list(self.chain())):
            if len(segment.items) > segment.input_count:
                starts.add(offset + segment.input_count)
            offset += len(segment.items)
        return frozenset(starts)

    def chain_size(self) -> int:
        return sum(segment.size for segment in self.chain())


@attrs.define(eq=False)
class StoredResponse:
    """A retained terminal Response: wire object, context chain and resolved ``preserve_thinking``.

    ``session_key`` is the chain's internal Engine session key (never part of ``body``): derived from the root's
    response id and inherited by every ``previous_response_id`` child.
    """

    response_id: str
    body: Mapping[str, Any]
    context: ContextSegment
    preserve_thinking: bool | None
    session_key: str | None = None
    envelope_size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.envelope_size = len(json_bytes(self.body))

    def standalone_size(self) -> int:
        """Bytes this Response needs when nothing else is retained."""
        return self.envelope_size + self.context.chain_size()


class ResponseStore:
    """Bounded LRU of :class:`StoredResponse` (single event-loop use; not thread-safe)."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one record and one byte")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._segment_refs: dict[ContextSegment, int] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str, *, param: str = "response_id") -> StoredResponse:
        """The retained Response (marked most recently used), or 404 ``response_not_found``."""
        record = self._records.get(response_id)
        if record is None:
            raise ResponseNotFoundError(
                f"no stored response with id {quoted(response_id)} (it was never stored, was created with "
                "store:false, was deleted, or was evicted from this server's bounded local store)", param=param)
        self._records.move_to_end(response_id)
        return record

    def check_fits(self, size: int) -> None:
        """Fail early when a Response of at least ``size`` bytes could never be stored."""
        if size > self.max_bytes:
            raise StoreCapacityError(
                f"the response needs {size} bytes of local store, more than --response-store-max-mib allows "
                f"({self.max_bytes} bytes); send store:false or raise the limit", param="store")

    def put(self, record: StoredResponse) -> None:
        """Retain ``record``, evicting least recently used Responses as needed."""
        self.check_fits(record.standalone_size())
        if record.response_id in self._records:
            raise ValueError(f"response {quoted(record.response_id)} is already stored")
        self._records[record.response_id] = record
        self._acquire(record)
        while len(self._records) > self.max_records or self._bytes > self.max_bytes:
            oldest = next(iter(self._records))
            if oldest == record.response_id:  # cannot happen: the record fits alone
                raise AssertionError("the response store cannot make room for a record that fits alone")
            self._remove(oldest)

    def delete(self, response_id: str) -> StoredResponse:
        """Remove a Response from public retrieval (404 when absent); its context lives on in retained children."""
        record = self.get(response_id)
        self._remove(response_id)
        return record

    def _remove(self, response_id: str) -> None:
        record = self._records.pop(response_id)
        self._bytes -= record.envelope_size
        for segment in record.context.chain():
            count = self._segment_refs[segment] - 1
            if count:
                self._segment_refs[segment] = count
            else:
                del self._segment_refs[segment]
                self._bytes -= segment.size

    def _acquire(self, record: StoredResponse) -> None:
        self._bytes += record.envelope_size
        for segment in record.context.chain():
            count = self._segment_refs.get(segment, 0)
            if not count:
                self._bytes += segment.size
            self._segment_refs[segment] = count + 1
