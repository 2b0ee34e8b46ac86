"""Incremental detokenisation with stop strings: what text a stream may emit after each token."""

from __future__ import annotations


def decode_many(tokenizer, windows: list[list[int]]) -> list[str]:
    """The text of each window of ids, as `tokenizer.decode(ids, skip_special_tokens=True)` gives it:
    through the Rust tokenizer's batch decode in one call where that is what `decode` does (a fast
    tokenizer without transformers' space clean-up), else one `decode` per window. One call for a
    step's 64 windows instead of 64 through transformers' wrapper (2 us each on a fast core, far more
    on a busy one, all of it holding the GIL the engine thread needs)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.decode_batch(windows, skip_special_tokens=True)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in windows]


def _backend(tokenizer):
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class TextStream:
    """Turns generated token ids into text deltas, holding back what may still become a stop string.

    Each token decodes only a short window of ids, not the whole generation (which would cost each
    request O(length) per token, O(length^2) over its life): the window starts a few tokens back
    (`_prefix`), because a token's text can depend on its neighbours (a leading space, a UTF-8 character
    split over tokens), and the new text is what the window decodes to beyond what its first part
    (`_prefix:_read`) already gave, as vLLM's detokenizer does."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:_read]
        self._prefix = self._read = 0
        self.emitted = 0  # characters of the text already sent
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that can be sent now (may be empty)."""
        return self.take(token_id, *decode_many(self.tokenizer, self.windows(token_id)))

    def windows(self, token_id: int | None = None) -> list[list[int]]:
        """The two windows of ids whose text `take` needs once `token_id` is added (nothing is added
        here: decode_many decodes the windows of many streams in one call, and may fail)."""
        window = self.ids[self._prefix:]
        return [self.ids[self._prefix:self._read], window + [token_id] if token_id is not None else window]

    def take(self, token_id: int, before: str, window: str) -> str:
        """Add a token, given the text of its `windows`; return the text that can be sent now (may be empty)."""
        self.ids.append(token_id)
        if not self._take_new(before, window, final=False):
            return ""
        text = self.text
        hits = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits))
        hold = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return self._emit(len(text) - hold)

    def flush(self) -> str:
        """At the end without a stop string: whatever was held back."""
        if self.stopped:
            return ""
        before, window = decode_many(self.tokenizer, self.windows())
        self._take_new(before, window, final=True)
        return self._emit(len(self.text))

    def _take_new(self, before: str, window: str, final: bool) -> bool:
        """Append the text the ids after `_read` complete; False while they end inside a character
        (unless `final`: then the replacement character is the text) or add no text yet."""
        if len(window) <= len(before) or (window.endswith("\ufffd") and not final):
            return False
        self.text += window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _emit(self, end: int) -> str:
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
