"""A serving process's start-up objects out of the garbage collector's sight: no full collection stops it.

CPython's full (generation 2) collection walks every object the process tracks, and every thread of
the process waits meanwhile: a step, the I/O loop, a re-plan's calls. A process that imported torch,
transformers and grpc tracks ~370k objects; a full collection took 140-150 ms on the 2-core machine.
In the H200 re-plan probe the frontend stood still for 230 and 350 ms at the same re-plan of two runs,
its re-plan thread too (that re-plan's loads were recorded as ending just then); a collection fits.
Those objects live as long as the process, so once it is ready `settle()` freezes them (gc.freeze,
as vLLM and SGLang do after loading): a later full collection walks only what came after (0.2 ms
here), and objects that die still go at once, by reference counting.
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def settle() -> None:
    """Collect what is garbage now (a frozen object is kept for good), then freeze everything left."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        # At exit they are collected as usual: extensions that count what was never freed (nanobind, which
        # torch's triton uses) would otherwise print pages of "leaked" objects.
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
