"""The engine's output thread: sampled token ids -> text deltas -> the callers' event loops.

Detokenising and streaming cost tens of microseconds a token in Python (two windowed decodes, the
stop strings, a Delta, a hand-over), 1 ms and more a step at batch 32 on the H200 host, and on the
engine thread that time came after every step's wait for the GPU and before the next step's launch.
Here it runs on a thread of its own while the engine thread launches the next step and waits for
the GPU (the wait releases the GIL). The engine thread keeps what decides the next step: each
sequence's tokens, end of sequence and its length limit. A stop string is found here, one or two
steps after its token was sampled: the final delta goes out at once, the sequence is marked
`stopped` for the engine to drop at its next step, and the tokens it sampled meanwhile are never sent.
Deltas of one sequence leave in the order their tokens were sampled (one thread, one queue).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubemoe.frontend.text import decode_many

if TYPE_CHECKING:  # the engine's Sequence, for its type only (engine.py imports this module)
    from kubemoe.frontend.engine import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "error" on the last delta
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class Outbox:
    """Deltas on their way to their callers' event loops, handed over once per batch of work: one
    call_soon_threadsafe per loop, not one per sequence. Each such call writes to the loop's wake-up
    socket, and the woken loop thread competes for the GIL with this one while it still has the
    batch's other sequences to do (at batch 32, per-sequence calls were about half of a step's output
    handling: 36 us a call)."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, delta: Delta) -> None:
        self._items.setdefault(loop, []).append((queue, delta))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, deliveries in items.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:  # the callers' loop has closed: nobody waits for these
                log.debug("dropped %d deltas for a closed event loop", len(deliveries))


def _deliver(deliveries: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue_, delta in deliveries:
        queue_.put_nowait(delta)


# One sampled token of a sequence: (sequence, token id or None for end of sequence, "length" where its
# limit is reached, None); or an error that ends it: (sequence, None, "error", message).
Item = tuple["Sequence", "int | None", "str | None", "str | None"]


class Output:
    def __init__(self, metrics=None):
        self.metrics = metrics
        self._queue: queue.SimpleQueue[list[Item] | None] = queue.SimpleQueue()
        self._outbox = Outbox()
        self._thread = threading.Thread(target=self._run, name="kubemoe-output", daemon=True)
        self._thread.start()

    def tokens(self, items: list[tuple["Sequence", int | None, str | None]]) -> None:
        """A pass's sampled tokens (from the engine thread)."""
        if items:
            self._queue.put([(seq, token, finish, None) for seq, token, finish in items])

    def errors(self, failed: list[tuple["Sequence", str]]) -> None:
        """These sequences end with their error, after whatever they sampled before."""
        if failed:
            self._queue.put([(seq, None, "error", message) for seq, message in failed])

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                decoded = self._decode(job)
            except Exception:  # noqa: BLE001 - each stream decodes on its own below, and fails on its own
                log.exception("decoding a pass's text failed; decoding each request's alone")
                decoded = {}
            for i, item in enumerate(job):
                try:
                    self._one(*item, decoded.get(i))
                except Exception:  # noqa: BLE001 - one request's text must not stop everyone's
                    log.exception("output of request %s failed", item[0].request_id)
                    self._finish(item[0], [], "", "error", "the server could not decode this request's text")
            self._outbox.flush()

    @staticmethod
    def _decode(job: list[Item]) -> dict[int, tuple[str, str]]:
        """The windows of the tokens a job streams, decoded in one call: {item's index: its texts}.
        Nothing is added to a stream here, so a failed call leaves each to decode on its own. A
        sequence's second token in one job (not something the engine sends) decodes on its own."""
        wanted, windows, seen = [], [], set()
        for i, (seq, token, *_) in enumerate(job):
            if token is None or seq.sent_last or id(seq) in seen:
                continue
            seen.add(id(seq))
            wanted.append(i)
            windows += seq.text.windows(token)
        if not wanted:
            return {}
        texts = decode_many(job[wanted[0]][0].text.tokenizer, windows)
        return {i: (texts[2 * n], texts[2 * n + 1]) for n, i in enumerate(wanted)}

    def _one(self, seq: "Sequence", token: int | None, finish: str | None, error: str | None,
             decoded: tuple[str, str] | None) -> None:
        if seq.sent_last:  # ended by a stop string or an error: what it sampled after that is not sent
            return
        if finish == "error":
            self._finish(seq, [], "", "error", error)
            return
        text = seq.text
        if token is None:  # end of sequence
            self._finish(seq, [], text.flush(), "stop")
            return
        delta = text.take(token, *decoded) if decoded is not None else text.push(token)
        if text.stopped:
            seq.stopped = True  # the engine drops it at its next step
            self._finish(seq, [token], delta, "stop")
        elif finish == "length":
            self._finish(seq, [token], delta + text.flush(), "length")
        else:
            self._outbox.put(seq.loop, seq.replies, Delta([token], delta, None, len(seq.prompt_ids), len(text.ids)))

    def _finish(self, seq: "Sequence", ids: list[int], text: str, reason: str, error: str | None = None) -> None:
        seq.sent_last = True
        completion = len(seq.text.ids)
        if self.metrics and reason != "error":
            self.metrics.completion_tokens.inc(completion)
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        self._outbox.put(seq.loop, seq.replies, Delta(ids, text, reason, len(seq.prompt_ids), completion, error=error))
