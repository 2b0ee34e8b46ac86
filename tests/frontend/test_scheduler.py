"""The batching scheduler is pure decision code: tested with plain objects, no model."""

import pytest

from kubemoe.frontend.scheduler import QueueFull, Scheduler, SchedulerConfig


def make_requests(n):
    return [object() for _ in range(n)]


def test_new_requests_join_the_running_batch_at_the_next_step():
    s = Scheduler(SchedulerConfig(max_batch=4, max_prefills_per_step=2))
    a, b, c = make_requests(3)
    for r in (a, b):
        s.add(r)
    plan = s.schedule()
    assert plan.prefill == [a, b] and plan.decode == []
    s.add(c)
    plan = s.schedule()
    assert plan.decode == [a, b] and plan.prefill == [c]


def test_batch_limit_and_prefill_limit():
    s = Scheduler(SchedulerConfig(max_batch=3, max_prefills_per_step=2))
    reqs = make_requests(5)
    for r in reqs:
        s.add(r)
    assert s.schedule().prefill == reqs[:2]
    assert s.schedule().prefill == reqs[2:3]  # the batch is full at 3
    assert s.schedule().prefill == []
    s.remove([reqs[0]])
    plan = s.schedule()
    assert plan.decode == reqs[1:3] and plan.prefill == reqs[3:4]


def test_finished_requests_leave_and_aborted_waiting_ones_too():
    s = Scheduler(SchedulerConfig(max_batch=1))
    a, b = make_requests(2)
    s.add(a)
    s.add(b)
    s.schedule()
    s.remove([a, b])
    assert s.idle


def test_bounded_queue_refuses_when_full():
    s = Scheduler(SchedulerConfig(max_waiting=2))
    s.add(object())
    s.add(object())
    with pytest.raises(QueueFull, match="retry later"):
        s.add(object())


def test_invalid_limits():
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch=0)
