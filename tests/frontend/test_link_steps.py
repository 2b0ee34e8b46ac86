"""The frontend's bookkeeping of device-linked decode steps (dispatch.py), without a GPU: a step that
settled counts its layers and calls, a void one drops the links that failed it (tried again later) and
moves the generation, so the programs that ran through them are captured again; /metrics says which."""

from __future__ import annotations

from types import SimpleNamespace

from .test_correctness import local_frontend


class _Link:
    closed = False

    def close(self):
        self.closed = True


def test_a_settled_step_counts_and_a_void_one_drops_the_links_that_failed_it(tiny_checkpoint):
    fe = local_frontend(tiny_checkpoint("mixtral"))
    dispatcher, metrics = fe.dispatcher, fe.metrics
    try:
        step = SimpleNamespace(plans={0: {"a:1": [0, 1], "b:2": [2]}, 1: {"a:1": [3]}}, answers_s=0.001, end_s=0.002)
        a, b = _Link(), _Link()
        dispatcher._links.update({"a:1": a, "b:2": b})
        generation = dispatcher.generation
        dispatcher._step_linked(step, {})
        assert dispatcher.linked_layers == 2 and list(dispatcher.link_waits) == [(0.001, 0.002)]
        assert metrics.expert_calls._value.get() == 3 and metrics.linked_steps.labels("ok")._value.get() == 1
        assert metrics.expert_parts._value.get() == 4  # each linked expert once
        assert dispatcher.generation == generation and dispatcher.launches_ahead
        dispatcher._step_linked(step, {"a:1": "the expert function closed the link during the step"})
        assert a.closed and not b.closed and set(dispatcher._links) == {"b:2"} and "a:1" in dispatcher._link_retry
        assert dispatcher.generation > generation  # the programs through a:1 are captured again
        assert dispatcher.linked_layers == 2 and metrics.linked_steps.labels("void")._value.get() == 1
        dispatcher.use_device_links(False)
        assert b.closed and not dispatcher._links and not dispatcher.launches_ahead
    finally:
        dispatcher._links.clear()
        fe.close()
