"""The scheduler's waiting queue: a set of requests that remembers insertion order. Pure Python.

Under overload it holds thousands of requests while a step admits, swaps or removes a handful,
so membership, append and removal cost O(1). It keeps no priority order: the scheduling policy
orders it each step (`SchedulingPolicy.order`), lazily where the policy can.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from segue.request import Request


class RequestQueue:
    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._by_id: dict[str, Request] = {}
        self.extend(requests)

    def append(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already queued")
        self._by_id[request.request_id] = request

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def remove(self, request: Request) -> None:
        if self._by_id.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id!r} is not queued")
        del self._by_id[request.request_id]

    def discard(self, request: Request) -> None:
        if self._by_id.get(request.request_id) is request:
            del self._by_id[request.request_id]

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and self._by_id.get(request.request_id) is request

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._by_id)})"
