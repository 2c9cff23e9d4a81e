import pytest

from tests.core.utils import make_request
from v1.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)


def test_fcfs_order_prepend_remove():
    q = FCFSRequestQueue()
    a, b, c = (make_request(4) for _ in range(3))
    for r in (a, b, c):
        q.add_request(r)
    assert q.peek_request() is a and len(q) == 3
    assert q.pop_request() is a
    q.prepend_request(a)
    assert list(q) == [a, b, c]
    q.remove_request(b)
    assert list(q) == [a, c]
    q.remove_requests([a, c])
    assert not q and len(q) == 0


def test_priority_order_then_arrival():
    q = PriorityRequestQueue()
    late_urgent = make_request(4, priority=0, arrival_time=5.0)
    early_lax = make_request(4, priority=1, arrival_time=1.0)
    early_urgent = make_request(4, priority=0, arrival_time=2.0)
    for r in (early_lax, late_urgent, early_urgent):
        q.add_request(r)
    assert list(q) == [early_urgent, late_urgent, early_lax]
    assert q.peek_request() is early_urgent
    q.remove_request(late_urgent)
    assert [q.pop_request(), q.pop_request()] == [early_urgent, early_lax]
    assert len(q) == 0


def test_priority_ties_on_equal_keys_do_not_crash():
    q = PriorityRequestQueue()
    a = make_request(4, priority=0, arrival_time=1.0)
    b = make_request(4, priority=0, arrival_time=1.0)
    q.add_request(a)
    q.add_request(b)
    assert {q.pop_request(), q.pop_request()} == {a, b}


def test_unknown_policy():
    with pytest.raises(ValueError, match="'lifo'"):
        create_request_queue("lifo")


def test_pop_window_fcfs_and_priority_ties():
    q = FCFSRequestQueue()
    reqs = [make_request(4) for _ in range(5)]
    for r in reqs:
        q.add_request(r)
    assert q.pop_window(3) == reqs[:3] and list(q) == reqs[3:]
    assert q.pop_window(9) == reqs[3:] and not q
    p = PriorityRequestQueue()
    a = make_request(4, priority=0, arrival_time=3.0)
    b = make_request(4, priority=0, arrival_time=1.0)
    c = make_request(4, priority=1, arrival_time=0.0)
    for r in (a, b, c):
        p.add_request(r)
    assert p.pop_window(9) == [b, a]  # the head's priority only, in order
    assert list(p) == [c]
    p.prepend_request(a)
    assert p.pop_window(1) == [a]
