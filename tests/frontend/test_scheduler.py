"""The batching scheduler is pure decision code: tested with plain objects, no model."""

import pytest

from kubemoe.frontend.scheduler import Chunk, QueueFull, Scheduler, SchedulerConfig, chunk_groups


class Seq:
    """What the scheduler reads of a sequence: tokens its cache holds after this step."""

    def __init__(self, prompt: int, generated: int = 0):
        self.prompt, self.generated = prompt, generated

    @property
    def context_length(self):
        return self.prompt + self.generated

    def __repr__(self):
        return f"Seq({self.prompt}, {self.generated})"


def make_requests(n, prompt=1):
    return [Seq(prompt) for _ in range(n)]


def chunks(plan):
    """(sequence, start, stop) of each chunk of a plan."""
    return [(c.seq, c.start, c.stop) for c in plan.chunks]


def test_new_requests_join_the_running_batch_at_the_next_step():
    s = Scheduler(SchedulerConfig(max_batch=4))
    a, b, c = make_requests(3)
    for r in (a, b):
        s.add(r)
    plan = s.schedule()
    assert plan.prefill == [a, b] and plan.decode == []
    s.add(c)
    plan = s.schedule()
    assert plan.decode == [a, b] and plan.prefill == [c]


def test_batch_limit_and_step_token_budget():
    # 5 tokens a step: decode tokens first, prompts (3 tokens each) in the rest
    s = Scheduler(SchedulerConfig(max_batch=3, max_step_tokens=5))
    reqs = make_requests(5, prompt=3)
    for r in reqs:
        s.add(r)
    assert chunks(s.schedule()) == [(reqs[0], 0, 3), (reqs[1], 0, 2)]  # 3 + 2 = 5
    plan = s.schedule()  # 5 - 1 decode = 4: reqs[1] continues first (1 token), reqs[2] whole (3)
    assert plan.decode == [reqs[0]] and chunks(plan) == [(reqs[1], 2, 3), (reqs[2], 0, 3)]
    assert s.running == reqs[:3] and s.prefilling == []
    plan = s.schedule()
    assert plan.decode == reqs[:3] and plan.chunks == []  # the batch is full at 3
    s.remove([reqs[0]])
    plan = s.schedule()
    assert plan.decode == reqs[1:3] and chunks(plan) == [(reqs[3], 0, 3)]


def test_a_decode_only_step_holds_prompts_back_and_says_a_prefill_is_next():
    s = Scheduler(SchedulerConfig(max_batch=2, max_step_tokens=4))
    a, b, c = Seq(1), Seq(6), Seq(2)
    s.add(a)
    assert s.has_prefill()
    s.schedule()
    assert not s.has_prefill()  # a decodes, nothing waits
    s.add(b)
    assert s.has_prefill()
    plan = s.schedule(prefill=False)  # e.g. a's pass is launched ahead: b waits for the next step
    assert plan.decode == [a] and plan.chunks == [] and list(s.waiting) == [b]
    plan = s.schedule()
    assert plan.decode == [a] and chunks(plan) == [(b, 0, 3)]
    s.add(c)
    plan = s.schedule(prefill=False)  # b's prefill part-way waits too, c is not admitted
    assert plan.decode == [a] and plan.chunks == [] and s.prefilling == [b] and s.has_prefill()
    assert chunks(s.schedule()) == [(b, 3, 6)]
    assert s.running == [a, b] and not s.has_prefill()  # c waits for a free slot, not for a prefill


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes_every_step():
    s = Scheduler(SchedulerConfig(max_batch=8, max_step_tokens=10))
    short, long, late = Seq(4), Seq(25), Seq(2)
    s.add(short)
    assert chunks(s.schedule()) == [(short, 0, 4)]
    s.add(long)
    s.add(late)
    # budget 10 - 1 decode = 9 a step for prompts; the long one continues before the late one is admitted
    steps = []
    for _ in range(4):
        steps.append(s.schedule())
        assert len(s.prefilling) <= 1  # only a step's last chunk stops short
    assert all(short in p.decode for p in steps)
    assert [chunks(p) for p in steps] == [
        [(long, 0, 9)],
        [(long, 9, 18)],
        [(long, 18, 25), (late, 0, 2)],  # 7 + 2 = 9
        [],
    ]
    assert [p.chunks[0].last for p in steps[:3]] == [False, False, True]
    assert steps[3].decode == [short, long, late]


def test_with_no_budget_left_after_decoding_nothing_is_admitted():
    s = Scheduler(SchedulerConfig(max_batch=8, max_step_tokens=2))
    a, b, c = make_requests(3)
    for r in (a, b):
        s.add(r)
    s.schedule()
    s.add(c)
    plan = s.schedule()
    assert plan.decode == [a, b] and plan.chunks == [] and list(s.waiting) == [c]
    s.remove([a])
    assert s.schedule().prefill == [c]


def test_chunks_of_the_same_start_and_length_share_a_forward_pass():
    a, b, c, d = Seq(4), Seq(4), Seq(6), Seq(8)
    plan = [Chunk(a, 0, 4), Chunk(c, 4, 6), Chunk(b, 0, 4), Chunk(d, 0, 4)]
    assert chunk_groups(plan) == [[plan[0], plan[2], plan[3]], [plan[1]]]
    assert [c.last for c in plan] == [True, True, True, False]


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

def test_admission_stops_at_the_first_request_the_cache_cannot_hold():
    s = Scheduler(SchedulerConfig(max_batch=8, max_step_tokens=1000))
    s.kv_capacity = 30  # positions: sequences x the longest
    a, b, c, d = Seq(10), Seq(5), Seq(12), Seq(2)
    for r in (a, b, c, d):
        s.add(r)
    plan = s.schedule()
    assert plan.prefill == [a, b]  # with c: 3 x 12 = 36 > 30; d, behind it, waits too (queue order)
    assert list(s.waiting) == [c, d]


def test_the_latest_admitted_are_preempted_when_the_batch_outgrows_the_cache_and_come_back_first():
    s = Scheduler(SchedulerConfig(max_batch=8, max_step_tokens=1000))
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


def test_a_sequence_part_way_through_its_prefill_is_preempted_first_and_starts_over():
    s = Scheduler(SchedulerConfig(max_batch=8, max_step_tokens=6))
    s.kv_capacity = 40
    a, long = Seq(5), Seq(12)
    s.add(a)
    s.schedule()
    s.add(long)
    assert chunks(s.schedule()) == [(long, 0, 5)]  # 2 x 12 = 24 reserved from admission
    a.generated = 16  # 2 x 21 = 42 > 40
    plan = s.schedule()
    assert plan.preempted == [long] and plan.decode == [a] and plan.chunks == []
    assert s.prefilling == [] and s.prefilled(long) == 0
    a.generated = 0
    assert chunks(s.schedule()) == [(long, 0, 5)]  # from its first token again


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
