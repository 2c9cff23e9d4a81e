"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival_time))."""

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from v1.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def pop_window(self, max_len: int) -> list[Request]:
        """Pop up to `max_len` requests from the head, in order, that the policy does not
        order among themselves (under priority: those tied with the head's priority)."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a preempted request back where it is served first among its peers."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_window(self, max_len: int) -> list[Request]:
        queue = self._queue
        return [queue.popleft() for _ in range(min(max_len, len(queue)))]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(map(id, requests))
        self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lower `priority` first; earlier `arrival_time` breaks ties. Iteration is in order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def peek_request(self) -> Request:
        return self._heap[0][2]

    def pop_window(self, max_len: int) -> list[Request]:
        heap = self._heap
        window: list[Request] = []
        while heap and len(window) < max_len and (
            not window or heap[0][0] == window[0].priority
        ):
            window.append(heapq.heappop(heap)[2])
        return window

    def prepend_request(self, request: Request) -> None:
        # The heap orders by (priority, arrival_time) alone; a preempted request keeps its
        # original arrival time, so it is still ahead of those that came after it.
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(map(id, requests))
        self._heap = [e for e in self._heap if id(e[2]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fcfs":
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: expected 'fcfs' or 'priority'")
