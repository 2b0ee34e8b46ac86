"""Experiment: what keeps a stack an Unload replaced from going back to the device (GPU test
test_what_an_unload_drops_goes_back_to_the_device_once_rounds_are_done_with_it failed at e8565fc).

Runs that test's steps, then says what memory came back after the store's settling, after a garbage
collection, and what still refers to the old stack's tensors.

    python benchmarks/experiments/unload_giveback_probe.py      # on a GPU
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "expert_fn"))
import test_load_gpu as t  # noqa: E402


def main() -> None:
    folder = tempfile.mkdtemp(dir="/dev/shm")
    adapter, layer, store, rounds = t._serving(t.mixtral_sized_checkpoint(Path(folder)))
    store.load([(layer, e) for e in range(4)])
    rounds.run()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    refs = [weakref.ref(store.stack(layer)), *(weakref.ref(store.get(layer, e)) for e in range(4))]
    held = torch.cuda.memory_reserved()
    store.unload([(layer, 1), (layer, 2), (layer, 3)])
    rounds.run()
    time.sleep(3)
    print(f"given back after settling: {(held - torch.cuda.memory_reserved()) >> 20} MiB; "
          f"old stack alive: {[r() is not None for r in refs]}")
    for n, r in enumerate(refs):
        if r() is not None:
            for referrer in gc.get_referrers(r()):
                print(f"  {n} referrer:", type(referrer).__name__, repr(referrer)[:200])
    gc.collect()
    torch.cuda.empty_cache()
    print(f"after gc.collect + empty_cache: {(held - torch.cuda.memory_reserved()) >> 20} MiB; "
          f"old stack alive: {[r() is not None for r in refs]}")
    rounds.close()


if __name__ == "__main__":
    main()
