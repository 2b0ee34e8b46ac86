"""Errors a user can act on. The CLI prints them as one line, never a traceback."""


class KubemoeError(Exception):
    """A failure whose message says what was wrong and what to do about it."""


class CheckpointError(KubemoeError):
    """The checkpoint folder is missing, malformed, or lacks a tensor kubemoe needs."""


class UnsupportedModelError(KubemoeError):
    """The checkpoint's architecture has no kubemoe adapter."""
