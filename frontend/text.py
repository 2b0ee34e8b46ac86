"""Incremental detokenisation with stop strings: what text a stream may emit after each token."""

from __future__ import annotations


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
        self.ids.append(token_id)
        if not self._decode_new(final=False):
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
        self._decode_new(final=True)
        return self._emit(len(self.text))

    def _decode_new(self, final: bool) -> bool:
        """Append the text the ids after `_read` complete; False while they end inside a character
        (unless `final`: then the replacement character is the text) or add no text yet."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(window) <= len(before) or (window.endswith("\ufffd") and not final):
            return False
        self.text += window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _emit(self, end: int) -> str:
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
