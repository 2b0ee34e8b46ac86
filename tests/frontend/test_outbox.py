"""The engine's outbox: a forward pass's deltas reach their callers' loops in one hand-over per loop."""

import asyncio
import types

from kubemoe.frontend.output import Delta, Outbox


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


def _through_output(text, prompt_ids, hand_over) -> tuple[types.SimpleNamespace, list[Delta]]:
    """A sequence streaming `text` (a TextStream) on a loop of its own; hand_over(output, seq) feeds the
    output thread as the engine does, which is then closed -> (the sequence, every delta it received)."""
    from kubemoe.frontend.output import Output

    loop = asyncio.new_event_loop()
    queue = asyncio.Queue()
    seq = types.SimpleNamespace(request_id="r1", prompt_ids=prompt_ids, text=text, loop=loop, replies=queue,
                                stopped=False, sent_last=False)
    output = Output()
    hand_over(output, seq)
    output.close()
    loop.run_until_complete(asyncio.sleep(0))
    deltas = []
    while not queue.empty():
        deltas.append(queue.get_nowait())
    loop.close()
    return seq, deltas


def test_the_output_thread_streams_a_sequence_in_order_and_ends_it_at_its_stop_string(tiny_checkpoint):
    """Tokens sampled after the stop string's (the engine has not dropped the sequence yet) are never
    sent; the sequence is marked for the engine to drop; an error for it afterwards sends nothing more."""
    from transformers import AutoTokenizer

    from kubemoe.frontend.text import TextStream

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("mixtral"))
    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]

    def hand_over(output, seq):
        for token in ids[:3]:  # one pass at a time, as the engine hands them over
            output.tokens([(seq, token, None)])
        output.tokens([(seq, token, None) for token in ids[3:]])
        output.errors([(seq, "too late")])

    seq, deltas = _through_output(TextStream(tokenizer, ("fox j",)), [1, 2], hand_over)
    assert "".join(d.text for d in deltas) == "The quick brown "
    assert [d.finish_reason for d in deltas].count("stop") == 1 and deltas[-1].finish_reason == "stop"
    assert seq.stopped and seq.sent_last
    assert deltas[-1].completion_tokens == len(seq.text.ids) < len(ids)  # the stop string's token, none after


def test_a_failed_batch_decode_leaves_each_stream_to_decode_alone(tiny_checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    from kubemoe.frontend import output as output_module
    from kubemoe.frontend.text import TextStream

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("mixtral"))
    text = "Experts scale one by one"
    ids = tokenizer(text)["input_ids"]

    def broken(tok, windows):
        raise RuntimeError("the batch decode failed")

    monkeypatch.setattr(output_module, "decode_many", broken)

    def hand_over(output, seq):
        for token in ids[:-1]:
            output.tokens([(seq, token, None)])
        output.tokens([(seq, ids[-1], "length")])

    seq, deltas = _through_output(TextStream(tokenizer), [1], hand_over)
    assert "".join(d.text for d in deltas) == text and seq.text.ids == ids  # no token added twice
    assert deltas[-1].finish_reason == "length"
