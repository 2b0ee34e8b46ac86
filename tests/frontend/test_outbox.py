"""The engine's outbox: a forward pass's deltas reach their callers' loops in one hand-over per loop."""

import asyncio

from kubemoe.frontend.engine import Delta, Outbox


def test_one_hand_over_per_loop_and_pass_in_order():
    loop = asyncio.new_event_loop()
    calls = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: calls.append(a) or original(*a)
    first, second = asyncio.Queue(), asyncio.Queue()
    outbox = Outbox()
    for queue, text in ((first, "a"), (second, "x"), (first, "b")):
        outbox.put(loop, queue, Delta([1], text))
    assert not calls  # nothing is handed over before the pass ends
    outbox.flush()
    assert len(calls) == 1
    loop.run_until_complete(asyncio.sleep(0))
    assert [first.get_nowait().text for _ in range(2)] == ["a", "b"] and second.get_nowait().text == "x"
    outbox.flush()  # empty: nothing more
    assert len(calls) == 1
    loop.close()


def test_a_closed_loop_drops_its_deltas_and_the_others_still_arrive():
    closed, open_ = asyncio.new_event_loop(), asyncio.new_event_loop()
    closed.close()
    queue = asyncio.Queue()
    outbox = Outbox()
    outbox.put(closed, asyncio.Queue(), Delta([], "", "stop"))
    outbox.put(open_, queue, Delta([2], "y"))
    outbox.flush()  # no exception from the closed one
    open_.run_until_complete(asyncio.sleep(0))
    assert queue.get_nowait().text == "y"
    open_.close()
