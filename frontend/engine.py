"""The engine: continuous batching over the model shell, one step at a time on its own thread.

`step()` is three calls, as in vLLM: the scheduler decides (pure), the model executes (one decode
for the running batch, then this step's prompt chunks), and the results update sequences and stream
text to their callers. The asyncio side only submits requests and reads their output queues.

A step with prompt chunks is one forward pass (step_pass.py): the running batch's decode rows and
every chunk of the step side by side along one row of tokens, each part attending over its own cache,
so a long prompt stalls the running requests for one pass of the step's token budget, not for a pass
of its own behind theirs, and prompts of any lengths share the pass with no padding. Chunks of the same
start and length (`scheduler.chunk_groups`) stack as rows of one part. A model whose attention cannot
mix parts (`step_pass.supports`: Llama-4, DeepSeek's latent attention) runs the decode pass and each
group's pass one after another. A prefill continued in a later step keeps its own cache
(`Sequence.partial`) until its last chunk, after which it joins the running batch and samples its
first token.

Look-ahead (`lookahead`, on a GPU where a decode pass never waits for the host: every expert in
process, or in expert functions on its GPU through device links): a greedy batch's next decode pass is launched from this pass's argmax on the device
before the host reads this pass's tokens, so the host's work between steps (sampling, streaming,
scheduling) runs while the GPU computes instead of the GPU waiting for it. A sequence that ends at
this step (its end-of-sequence token, a stop string, its caller gone) had a row in the pass already
launched: that row's output is dropped and its cache row goes with the sequence. Steps whose
sequences sample, reach their last token or record their routing launch nothing ahead, nor do steps
that find a prompt to prefill next (it rides in the next step's pass, which must not be launched yet;
a prompt that arrives after a pass was launched ahead waits one step for it). A pass through
device links is known to hold only once settled (graphs.py), which the step does after it launched the
next one, so the GPU never waits for the host between the two; a void pass is undone, with the one
launched from its logits, and decoded again.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np
import torch
from transformers import DynamicCache

from kubemoe.frontend.batch import BatchState, DecodeMasks, split_rows, upload_ints
from kubemoe.frontend import step_pass
from kubemoe.frontend.records import ForwardRows
from kubemoe.frontend.sampling import SamplingParams, greedy_tokens, sample_next
from kubemoe.frontend.graphs import DecodeGraphs, VoidStep
from kubemoe.frontend.kv_cache import KVCacheConfig
from kubemoe.frontend.output import Delta, Output
from kubemoe.frontend.scheduler import (Chunk, QueueFull, Scheduler, SchedulerConfig, StepPlan, cached_tokens,
                                        chunk_groups)
from kubemoe.frontend.text import TextStream

log = logging.getLogger(__name__)

__all__ = ["Engine", "Delta", "InvalidPrompt", "PromptTooLong", "QueueFull", "EngineError"]


class InvalidPrompt(ValueError):
    """The prompt cannot run: empty, or a token id outside the vocabulary."""


class PromptTooLong(InvalidPrompt):
    """The prompt does not fit the model's context."""


class EngineError(RuntimeError):
    """A step failed (e.g. no expert replica could serve a layer); the affected requests get this."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    loop: asyncio.AbstractEventLoop  # the caller's, and its queue of deltas
    replies: asyncio.Queue
    generator: torch.Generator | None
    max_new: int
    generated: list[int] = field(default_factory=list)
    aborted: bool = False  # the caller went away
    stopped: bool = False  # its text reached a stop string (set by the output thread)
    sent_last: bool = False  # its final delta is out (the output thread's)
    partial: DynamicCache | None = None  # the cache of a prefill that continues in a later step
    started: float = field(default_factory=time.monotonic)

    @property
    def context_length(self) -> int:
        """Tokens its cache holds once this step has run: the prompt and everything generated."""
        return len(self.prompt_ids) + len(self.generated)


@dataclass
class RunningBatch:
    """The running sequences with their KV cache, decoded by one forward pass a step."""

    state: BatchState
    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # each sequence's last token, batch order

    def keep(self, keep: list[int]) -> None:
        self.state.keep(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self.tokens = [self.tokens[i] for i in keep]


class _VoidPass(Exception):
    """This step's decode pass went through a device link that failed it (graphs.VoidStep): run it again."""


@dataclass(eq=False)
class Ahead:
    """The batch's decode pass launched before the host read the previous pass's tokens."""

    seqs: list[Sequence]  # the batch's sequences when it was launched, in row order
    logits: torch.Tensor  # [len(seqs), V] on the device, being computed

    def logits_of(self, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of `seqs` (those still in the batch, in its order now)."""
        if seqs == self.seqs:
            return self.logits
        row = {id(seq): i for i, seq in enumerate(self.seqs)}
        return self.logits[upload_ints([row[id(seq)] for seq in seqs], self.logits.device)]


class Engine:
    def __init__(self, model, tokenizer, eos_ids: set[int], max_context: int,
                 scheduler: SchedulerConfig = SchedulerConfig(), before_step=None, metrics=None, loads=None,
                 on_forward=None, kv_cache: KVCacheConfig = KVCacheConfig(),
                 graphs: DecodeGraphs | None = None, lookahead: Callable[[], bool] | None = None,
                 decode_model: Callable[..., Any] | None = None):
        self.model, self.tokenizer, self.eos_ids, self.max_context = model, tokenizer, eos_ids, max_context
        self.scheduler: Scheduler[Sequence] = Scheduler(scheduler)
        self.before_step = before_step  # e.g. the dispatcher switching routing tables between steps
        self.metrics, self.loads = metrics, loads
        self.on_forward = on_forward  # callable(ForwardRows) before each forward pass: whose rows it computes
        self.device = next(model.parameters()).device
        self.kv_cache = kv_cache
        self.graphs = graphs  # decode passes replayed as CUDA graphs (graphs.py); None: launched one by one
        # What a decode pass launched op by op calls: the model, or the model compiled (compiled.py; `graphs`
        # are built over the same). Prefill passes call the model.
        self.decode_model = model if decode_model is None else decode_model
        # Whether a decode pass runs without waiting for the host now (see the module's docstring); None: never.
        self.lookahead = lookahead
        self._ahead: Ahead | None = None
        self.kv_bytes_per_token: int | None = None  # measured on the first prefill (every architecture caches its own way)
        self.kv_budget: int | None = None  # bytes; None: unbounded
        self.scheduler.measuring = kv_cache.bounded(self.device)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.masks = DecodeMasks.of(model.config)
        self.step_passes = step_pass.supports(model.config, self.masks)  # decode rows and chunks in one pass
        self.batch = self._new_batch()
        self._wake = threading.Condition()
        self._output = Output(metrics)  # sampled tokens -> text deltas, on a thread of its own
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kubemoe-engine", daemon=True)
        self._thread.start()

    def _new_batch(self) -> RunningBatch:
        state = BatchState(self.masks)
        state.budget = self.scheduler.kv_capacity
        return RunningBatch(state)

    # -- asyncio side ---------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """Stream deltas for one request. Raises InvalidPrompt (PromptTooLong) or QueueFull before anything runs."""
        if not prompt_ids:
            raise InvalidPrompt("the prompt is empty; send at least one token")
        bad = next((i for i in prompt_ids if isinstance(i, bool) or not isinstance(i, int)
                    or not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad!r} is not in this model's vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_context} "
                                "tokens (prompt plus at least one generated token): shorten the prompt")
        capacity = self.scheduler.kv_capacity
        if capacity is not None and len(prompt_ids) >= capacity:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; this frontend's KV cache holds {capacity} "
                                "(prompt plus at least one generated token): shorten the prompt, or give the frontend "
                                "a larger --kv-cache-bytes")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        seq = Sequence(request_id, list(prompt_ids), params, TextStream(self.tokenizer, params.stop), loop, queue,
                       params.generator(),
                       min(params.max_tokens, self.max_context - len(prompt_ids)))
        self._cap_generation(seq)
        with self._wake:
            self.scheduler.add(seq)  # QueueFull propagates to the caller
            self._wake.notify()
        if self.metrics:
            self.metrics.queue_depth.set(len(self.scheduler.waiting))
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finish_reason:
                    return
        finally:
            seq.aborted = True  # a caller that went away frees its batch slot at the next step

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self._output.close()

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and self.scheduler.idle:
                    self._wake.wait()
                if self._stopped:
                    return
                self._drop_aborted()
                # The running batch's pass launched ahead holds its decode rows: chunks ride in the next one
                plan = self.scheduler.schedule(prefill=self._ahead is None or not self.step_passes)
            if plan.empty:
                continue
            try:
                self.step(plan)
            except Exception as e:  # noqa: BLE001 - a fault outside any one forward pass (a bug): end the
                # step's requests loudly, with a fresh batch, and keep serving the queue
                log.exception("engine step failed")
                with self._wake:
                    self.batch = self._new_batch()
                    self._ahead = None
                self._settled()  # a pass launched ahead ends before anything queued after it waits for the GPU
                self._fail([(seq, _message(e)) for seq in plan.decode + plan.prefill])

    @torch.inference_mode()
    def step(self, plan: StepPlan[Sequence]) -> None:
        """Decode the running batch and prefill this step's prompt chunks, in one pass where the model
        allows (step_pass.py). A forward pass that fails ends only the requests it names (`failed_rows`);
        the rest of a decode batch is rolled back and decodes again at the next step, the rest of its
        prompts start their prefill over. Sampling that fails ends only its own request."""
        if plan.rejected:  # out of the queue already: they end first, whatever in this step fails after
            self._fail([(seq, self._too_long(seq)) for seq in plan.rejected])
        if self.before_step:
            self.before_step()
        finished, failed = [], []
        if plan.preempted:
            self._leave_batch(plan.preempted)  # back in the queue; prefilled again (recompute) when there is room
        batch = self.batch
        if self._ahead is not None and not batch.seqs:
            self._ahead = None  # its sequences all ended: nothing reads it
            self._settled()
        groups = chunk_groups(plan.chunks)
        rides = self.step_passes and bool(groups) and bool(batch.seqs) and self._ahead is None
        if batch.seqs and not rides:
            result, greedy = self._decode(batch), None
            if not isinstance(result, Exception):
                try:
                    # A step with prompt chunks joins sequences to the batch after this: nothing ahead of it.
                    greedy = None if plan.chunks else self._look_ahead(batch, result)
                    if greedy is None and not self._settled():
                        raise _VoidPass
                except _VoidPass:  # a linked expert function failed this step's pass: it runs again, as calls
                    batch.state.undo_decode()
                    result = self._decode(batch, settle=True)
            if isinstance(result, Exception):
                self._settled()  # whatever it launched ends before its rows are rolled back
                failed += self._pass_failed(result, batch, [])
            else:
                finished += self._decoded(batch, result, failed, greedy)
        if groups and self.step_passes:
            finished += self._prefill(groups, batch if rides else None, failed)
        else:
            for group in groups:
                finished += self._prefill([group], None, failed)
        if failed:
            self._fail(failed)
        if finished:
            self._remove(finished)
        self._record_cache(len(plan.preempted))

    def _prefill(self, groups: list[list[Chunk[Sequence]]], decode: RunningBatch | None,
                 failed: list) -> list[Sequence]:  # -> the sequences that finished
        """One forward pass over chunk groups (each: chunks of one start and length, a row each) and, with
        `decode`, the running batch's decode rows (step_pass.py). After it each group's cache is split into
        one per sequence; a sequence whose last chunk ran joins the running batch and samples its first
        token. A failed pass ends the sequences whose rows it names (`_pass_failed`)."""
        chunks = [chunk for group in groups for chunk in group]
        decoding = decode.seqs if decode is not None else []
        # Only a step's last chunk can stop short of its context's end (the budget ran out there), so a
        # continued chunk is alone in its group, on the cache its earlier chunks left.
        caches = [group[0].seq.partial if group[0].start else DynamicCache() for group in groups]
        self._announce(decoding, chunks)
        if decode is not None:
            decode.state.advance(decode.tokens)
        try:
            logits = self._prefill_logits(groups, caches, decode)
        except Exception as e:  # noqa: BLE001 - this pass failed: only the requests it names end
            failed += self._pass_failed(e, decode, chunks)
            return []
        finished = self._decoded(decode, logits[:len(decoding)], failed) if decode is not None else []
        at = len(decoding)
        for group, cache in zip(groups, caches):
            finished += self._prefilled(group, cache, logits[at:at + len(group)], failed)
            at += len(group)
        return finished

    def _announce(self, decoding: list[Sequence], chunks: list[Chunk[Sequence]]) -> None:
        """Tell `on_forward` whose rows a pass computes, in its order: each decoding sequence's last token
        (at position prompt + generated - 1), then each chunk's tokens."""
        if self.on_forward:
            self.on_forward(ForwardRows(tuple(s.request_id for s in decoding) + tuple(c.seq.request_id for c in chunks),
                                        tuple(s.context_length - 1 for s in decoding) + tuple(c.start for c in chunks),
                                        (1,) * len(decoding) + tuple(c.tokens for c in chunks)))

    def _prefill_logits(self, groups: list[list[Chunk[Sequence]]], caches: list[DynamicCache],
                        decode: RunningBatch | None) -> torch.Tensor:
        """The pass of `_prefill` -> logits [decode rows + chunks, V]: each decode row's, then each chunk's
        last position's (all of a 4000-token chunk's would be a [4000, V] matmul and 0.5 GB of float32 for
        one row that is sampled)."""
        chunks = [c for group in groups for c in group]
        rows = [(c.seq.prompt_ids + c.seq.generated)[c.start:c.stop] for c in chunks]
        if not self.step_passes:  # one block of rows: transformers' own pass over its cache
            ids = upload_ints(rows, self.device)
            return self.model(input_ids=ids, cache=caches[0], use_cache=True, logits_to_keep=1).logits[:, -1]
        decoding = len(decode.seqs) if decode is not None else 0
        parts, keep, at = [], list(range(decoding)), decoding
        for group, cache in zip(groups, caches):
            first = group[0]
            part = step_pass.Group(cache, len(group), first.start, first.tokens,
                                   self.masks.prompt(first.start, first.stop, self.device))
            keep += [at + (row + 1) * part.length - 1 for row in range(part.rows)]  # each row's last token
            parts.append(part)
            at += part.tokens
        ids, positions = upload_ints(np.concatenate([[row, np.arange(c.start, c.stop)] for c, row in zip(chunks, rows)],
                                                    axis=1), self.device).unbind(0)
        if decode is not None:
            inputs = decode.state.pass_inputs(decoding)  # as `advance` left them
            ids = torch.cat([inputs["input_ids"].view(-1), ids])
            positions = torch.cat([inputs["position_ids"].view(-1), positions])
            cache = step_pass.StepCache(inputs["cache"], inputs["attention_mask"], parts)
        else:
            cache = step_pass.StepCache(None, None, parts)
        # Each part attends with its own mask (step_pass.py); a 4D mask is taken as given, so transformers builds none
        given = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        return self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=given, cache=cache,
                          use_cache=True, logits_to_keep=upload_ints(keep, self.device),
                          **{step_pass.KEYWORD: cache}).logits[0]

    def _prefilled(self, group: list[Chunk[Sequence]], cache: DynamicCache, logits: torch.Tensor,
                   failed: list) -> list[Sequence]:  # -> the sequences that finished
        """After a pass: the group's cache split into one per sequence; a sequence whose last chunk ran
        joins the running batch and samples its first token from its row of `logits` [rows, V]."""
        if self.metrics:
            self.metrics.prefill_chunks.inc(len(group))
        if self.kv_bytes_per_token is None:
            self._measure_cache(cache, len(group) * group[0].stop)
        if self.loads:
            self.loads.record_tokens(sum(chunk.tokens for chunk in group))
        batch, joined = self.batch, []  # indices in `group` of the sequences that join, sampled together
        for i, (chunk, row) in enumerate(zip(group, split_rows(cache, len(group)))):
            seq = chunk.seq
            seq.partial = None if chunk.last else row
            if chunk.last:
                batch.state.join(row, seq.context_length)
                batch.seqs.append(seq)
                batch.tokens.append(0)
                joined.append(i)
                if self.metrics and not seq.generated:  # a preempted sequence had its first token long ago
                    self.metrics.ttft.observe(time.monotonic() - seq.started)
        if not joined:
            return []
        if len(joined) < len(group):
            logits = logits[upload_ints(joined, logits.device)]
        first = len(batch.seqs) - len(joined)
        return self._advance_all([group[i].seq for i in joined], logits, batch, range(first, len(batch.seqs)), failed)

    # -- the KV cache's bound -------------------------------------------------------------------

    def _measure_cache(self, cache: DynamicCache, tokens: int) -> None:
        """Bytes per cached token from a real cache, then the capacity in tokens from the budget."""
        self.kv_bytes_per_token = max(1, sum(l.keys.nbytes + l.values.nbytes for l in cache.layers
                                             if getattr(l, "keys", None) is not None) // tokens)
        self.kv_budget = self.kv_cache.budget(self.device)
        if self.kv_budget is not None:
            capacity = self.kv_budget // self.kv_bytes_per_token
            with self._wake:
                self.scheduler.kv_capacity = capacity
                self.batch.state.budget = capacity
                for seq in self.scheduler.running + self.scheduler.prefilling + list(self.scheduler.waiting):
                    self._cap_generation(seq)
            log.info("KV cache: %d bytes per token, budget %d bytes = %d token positions", self.kv_bytes_per_token,
                     self.kv_budget, capacity)
        self.scheduler.measuring = False
        if self.metrics and self.kv_budget is not None:
            self.metrics.kv_cache_budget_bytes.set(self.kv_budget)

    def _cap_generation(self, seq: Sequence) -> None:
        """A sequence alone must fit the cache: its generation ends ("length") where it would not."""
        capacity = self.scheduler.kv_capacity
        if capacity is not None:
            seq.max_new = max(1, min(seq.max_new, capacity - len(seq.prompt_ids)))

    def _out_of_memory(self, error: BaseException) -> bool:
        """The device ran out despite the budget (other memory grew, e.g. experts loaded later): shrink the
        cache's capacity below what the batch holds now, so the scheduler preempts; False where that cannot help."""
        with self._wake:
            batch = self.scheduler.running + self.scheduler.prefilling
            held = cached_tokens(batch)
            if self.kv_bytes_per_token is None or len(batch) < 2:
                return False
            self.scheduler.kv_capacity = int(held * 0.9)
            self.batch.state.budget = self.scheduler.kv_capacity
        log.warning("out of device memory with %d cached tokens (%s): the KV cache's capacity is now %d tokens",
                    held, error, self.scheduler.kv_capacity)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def _record_cache(self, preempted: int) -> None:
        if not self.metrics or self.kv_bytes_per_token is None:
            return
        used = len(self.batch.state) * self.batch.state.width
        used += sum(self.scheduler.prefilled(seq) for seq in self.scheduler.prefilling)
        used *= self.kv_bytes_per_token
        self.metrics.kv_cache_used_bytes.set(used)
        if preempted:
            self.metrics.preemptions.inc(preempted)

    def _too_long(self, seq: Sequence) -> str:
        return (f"the request needs {seq.context_length + 1} cache positions; this frontend's KV cache holds "
                f"{self.scheduler.kv_capacity}: give the frontend a larger --kv-cache-bytes")

    def _decode(self, batch: RunningBatch, settle: bool = False) -> torch.Tensor | Exception:  # -> logits [B, V]
        """The batch's decode pass: launched by the last step (_look_ahead) or now. Unless `settle`, a pass
        through device links may not have settled: the step settles it (`_settled`) before reading it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # only joins came after it
            return ahead.logits_of(batch.seqs)
        self._announce(batch.seqs, [])
        try:
            return self._pass(batch.state, batch.tokens, self._rows(len(batch.seqs)), settle=settle)
        except Exception as e:  # noqa: BLE001 - handed back: the step decides whom it ends
            return e

    def _rows(self, sequences: int) -> int | None:
        """The rows a decode pass of `sequences` is prepared for: its graph program's; None: launched op by op."""
        return self.graphs.rows(sequences) if self.graphs else None

    def _pass(self, state: BatchState, tokens: list[int] | torch.Tensor, rows: int | None,
              settle: bool = True) -> torch.Tensor:
        """One decode pass over `state` feeding `tokens` (host ids, or on the device), replayed as the program
        of `rows` rows, or launched op by op where `rows` is None -> logits [len(state), V]. `settle=False`:
        a replay through device links is left for `_settled` (graphs.py)."""
        state.advance(tokens, rows)
        if self.graphs is None or rows is None:
            return self.decode_model(**state.pass_inputs(len(state)), use_cache=True).logits[:, -1]
        return self.graphs.decode(state, rows, len(state), settle=settle)

    def _settled(self, keep: int = 0) -> bool:
        """Settle the passes through device links still in flight but the newest `keep` (graphs.py) ->
        whether they hold (False: one was void)."""
        if self.graphs is None:
            return True
        try:
            self.graphs.settle(keep)
        except VoidStep:
            return False
        return True

    def _look_ahead(self, batch: RunningBatch, logits: torch.Tensor) -> dict[int, int] | None:
        """Launch the batch's next decode pass from `logits`' argmax on the device, settle the pass of
        `logits`, then read that argmax -> {row: token} of every row (None: nothing launched, the caller
        settles and samples; _VoidPass: the pass of `logits` was void, and what was launched from it is undone)."""
        seqs, state = batch.seqs, batch.state
        if (self.lookahead is None or self.on_forward is not None
                or any(seq.params.temperature != 0.0 or len(seq.generated) + 1 >= seq.max_new for seq in seqs)
                or (self.step_passes and self.scheduler.has_prefill()) or not self.lookahead()):
            return None
        rows = self._rows(len(seqs))
        if not state.fits_step(rows or len(seqs)):  # the cache would grow (and graphs be captured again)
            return None
        if self.graphs is not None and (rows is None or not self.graphs.launches_behind(state, rows)) \
                and not self._settled():  # the next pass would wait for this one's GPU work, unbounded
            raise _VoidPass
        tokens = logits.argmax(-1)
        host = torch.empty(len(seqs), dtype=torch.long, pin_memory=tokens.is_cuda)
        host.copy_(tokens, non_blocking=True)  # queued before the next pass: ready when this one is
        read = torch.cuda.Event() if tokens.is_cuda else None
        if read is not None:
            read.record()
        try:
            self._ahead = Ahead(list(seqs), self._pass(state, tokens, rows, settle=False))
        except Exception:  # noqa: BLE001 - the next step decodes as usual
            log.exception("a decode pass launched ahead failed; the next step runs it again")
            state.undo_decode()
        # Only now, the next pass queued behind it: the GPU never idles between the two while the host waits
        if not self._settled(keep=int(self._ahead is not None)):
            if self._ahead is not None:  # launched from void logits: it goes too
                self._ahead = None
                self._settled()
                state.undo_decode()
            raise _VoidPass
        if read is not None:
            read.synchronize()
        return dict(enumerate(host.tolist()))

    def _pass_failed(self, error: Exception, decode: RunningBatch | None,
                     chunks: list[Chunk[Sequence]]) -> list[tuple[Sequence, str]]:
        """A forward pass over `decode`'s rows and `chunks` failed: the requests whose rows the error names
        end (none when the device ran out of memory and a smaller cache can make room: the scheduler
        preempts); the batch is rolled back to before the pass and the other chunks' sequences start their
        prefill over (their caches grew part-way), as after a preemption."""
        decoding = decode.seqs if decode is not None else []
        seqs = decoding + [chunk.seq for chunk in chunks]
        if isinstance(error, torch.OutOfMemoryError) and self._out_of_memory(error):
            named: set[int] = set()
        else:
            log.error("a pass over %d decode rows and %d prompt chunks (requests %s) failed: %s", len(decoding),
                      len(chunks), [s.request_id for s in seqs], _message(error), exc_info=error)
            named = set(failed_rows(error, [1] * len(decoding) + [chunk.tokens for chunk in chunks]))
        if decode is not None:
            try:
                decode.state.undo_decode()
            except Exception:  # noqa: BLE001 - a cache that cannot be rolled back takes the whole batch
                log.exception("the failed step's cache could not be rolled back; the batch ends")
                named |= set(range(len(decoding)))
        self._leave_batch([seq for i, seq in enumerate(seqs) if i >= len(decoding) and i not in named], requeue=True)
        return [(seqs[i], _message(error)) for i in sorted(named)]

    def _decoded(self, batch: RunningBatch, logits: torch.Tensor, failed: list,
                 greedy: dict[int, int] | None = None) -> list[Sequence]:
        """The batch's next tokens from its decode pass's logits -> the sequences that finished."""
        if self.loads:
            self.loads.record_tokens(len(batch.seqs))
        return self._advance_all(batch.seqs, logits, batch, range(len(batch.seqs)), failed, greedy)

    def _advance_all(self, seqs: list[Sequence], logits: torch.Tensor, batch: RunningBatch, indices,
                     failed: list, greedy: dict[int, int] | None = None) -> list[Sequence]:
        """Each sequence's next token from logits [len(seqs), V] (`greedy`: those already read, by row)
        -> the sequences that finished."""
        done: list[Sequence] = []
        sampled: list[tuple[Sequence, int | None, str | None]] = []  # to the output thread
        if greedy is None:
            greedy = greedy_tokens(logits, [seq.params for seq in seqs])
        for i, (seq, row, index) in enumerate(zip(seqs, logits, indices)):
            try:
                token = greedy[i] if i in greedy else sample_next(row, seq.params, seq.generator)
            except Exception as e:  # noqa: BLE001 - e.g. a row of NaN logits: only its request ends
                log.exception("sampling for request %s failed", seq.request_id)
                failed.append((seq, _message(e)))
                continue
            batch.tokens[index] = token
            if token in self.eos_ids:
                sampled.append((seq, None, "stop"))
                done.append(seq)
                continue
            seq.generated.append(token)
            end = len(seq.generated) >= seq.max_new
            sampled.append((seq, token, "length" if end else None))
            if end:
                done.append(seq)
        self._output.tokens(sampled)  # detokenised and streamed on the output thread
        return done

    def _remove(self, gone: list[Sequence]) -> None:
        """Finished or aborted sequences leave the batch and the scheduler."""
        with self._wake:
            self._leave_batch(gone)
            self.scheduler.remove(gone)

    def _leave_batch(self, gone: list[Sequence], requeue: bool = False) -> None:
        """Sequences leave the batch (their cache is freed); `requeue`: back to the head of the queue."""
        gone_ids = {id(s) for s in gone}
        for seq in gone:
            seq.partial = None  # a prefill that starts over (or never) starts from a new cache
        with self._wake:
            batch = self.batch
            if any(id(s) in gone_ids for s in batch.seqs):
                batch.keep([i for i, s in enumerate(batch.seqs) if id(s) not in gone_ids])
            if requeue:
                self.scheduler.remove(gone)
                self.scheduler.waiting.extendleft(reversed(gone))

    def _drop_aborted(self) -> None:
        aborted = [s for s in list(self.scheduler.waiting) + self.scheduler.running + self.scheduler.prefilling
                   if s.aborted or s.stopped]
        if aborted:
            self._remove(aborted)

    def _fail(self, failed: list[tuple[Sequence, str]]) -> None:
        """These requests end with their error; every other sequence goes on."""
        self._remove([seq for seq, _ in failed])
        self._output.errors(failed)


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def failed_rows(error: BaseException, lengths: list[int]) -> range | list[int]:
    """The sequences a failed forward pass must end, of those with `lengths` token rows each in the pass's
    order: those whose rows the error names (a DispatchError's `rows`, the batch flattened as MoE blocks
    see it), else all of them."""
    rows = getattr(error, "rows", None)
    if rows is None:
        return range(len(lengths))
    ends = list(itertools.accumulate(lengths))
    return sorted({bisect.bisect_right(ends, row) for row in rows})
