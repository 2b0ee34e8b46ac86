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


# -- a bounded KV cache --------------------------------------------------------------------------

class Seq:
    """What the scheduler reads of a sequence: tokens its cache holds after this step."""

    def __init__(self, prompt: int, generated: int = 0):
        self.prompt, self.generated = prompt, generated

    @property
    def context_length(self):
        return self.prompt + self.generated


def test_admission_stops_at_the_first_request_the_cache_cannot_hold():
    s = Scheduler(SchedulerConfig(max_batch=8, max_prefills_per_step=8))
    s.kv_capacity = 30  # positions: sequences x the longest
    a, b, c, d = Seq(10), Seq(5), Seq(12), Seq(2)
    for r in (a, b, c, d):
        s.add(r)
    plan = s.schedule()
    assert plan.prefill == [a, b]  # with c: 3 x 12 = 36 > 30; d, behind it, waits too (queue order)
    assert list(s.waiting) == [c, d]


def test_the_latest_admitted_are_preempted_when_the_batch_outgrows_the_cache_and_come_back_first():
    s = Scheduler(SchedulerConfig(max_batch=8, max_prefills_per_step=8))
    s.kv_capacity = 30
    a, b, c, late = Seq(8), Seq(6), Seq(4), Seq(1)
    for r in (a, b, c):
        s.add(r)
    assert s.schedule().prefill == [a, b, c]  # 3 x 8 = 24
    s.add(late)
    a.generated = 3  # 3 x 11 = 33: no longer fits
    plan = s.schedule()
    assert plan.preempted == [c] and plan.decode == [a, b] and plan.prefill == []
    assert list(s.waiting) == [c, late] and s.preemptions == 1
    a.generated = b.generated = 0
    s.remove([a])
    assert s.schedule().prefill == [c, late]  # room again: the preempted one first


def test_a_request_that_cannot_fit_even_alone_is_rejected_and_one_alone_is_never_preempted():
    s = Scheduler(SchedulerConfig())
    s.kv_capacity = 10
    big, ok = Seq(10), Seq(3)
    s.add(big)
    s.add(ok)
    plan = s.schedule()
    assert plan.rejected == [big] and plan.prefill == [ok]
    ok.generated = 20
    assert s.schedule().preempted == []


def test_while_the_bytes_per_token_are_measured_one_sequence_runs_alone():
    s = Scheduler(SchedulerConfig())
    s.measuring = True
    a, b = Seq(3), Seq(3)
    s.add(a)
    s.add(b)
    assert s.schedule().prefill == [a]
    assert s.schedule().prefill == []
    s.measuring = False
    assert s.schedule().prefill == [b]
