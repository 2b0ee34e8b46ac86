"""Incremental detokenisation with stop strings: what text a stream may emit after each token."""

from __future__ import annotations


class TextStream:
    """Turns generated token ids into text deltas, holding back what may still become a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already sent
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that can be sent now (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        hits = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(text, min(hits))
        hold = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return self._emit(text, len(text) - hold)

    def flush(self) -> str:
        """At the end without a stop string: whatever was held back."""
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True), None)

    def _emit(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
