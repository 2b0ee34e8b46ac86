"""One in-place Load at a time among the expert functions of a node: a file lock in the folder they share.

A Load reads expert weights through the host's memory and its link to the GPUs, which every call's
tensors also cross. Functions that follow the routing table (follow.py) see a new table within moments
of each other, and each Loads what it gains: without coordination they all Load at once, and steps
served meanwhile slow down more than when they Load one at a time (measured with the frontend's
Replanner, frontend/replan.py, which a driver of the table and the functions uses to the same end).

Start-up loads of bundles take it too: a node's functions restarting together (a rollout, a node
reboot) read their bundles one after another, while the functions that still serve keep their link to
the GPU, and each is Ready as soon as its own bundle is in rather than all at the end.

The lock is an flock(2) on a file in the node folder a MoEDeployment's functions already share for
shared memory (`--shm-dir`: kubemoe.pod_args.node_shm_dir under spec.dataPath.sameNode hostShm; `kubemoe
serve`'s local folder). Functions without one (sameNode tcp: no folder on the node is shared) Load
uncoordinated, and so do those of two MoEDeployments on one node. The kernel drops the lock with the
process, so a function that dies mid-Load holds nobody up.

The file is the user's own (`.kubemoe-load-<uid>.lock`, mode 0600): the folder may be one every user
writes in (a machine's /dev/shm, the expert function's default --shm-dir), where another user's file of
that name would otherwise make this user's Loads fail. A function that cannot open it Loads without it,
and says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import AsyncContextManager, AsyncIterator

log = logging.getLogger(__name__)
POLL_S = 0.01  # a Load takes 0.1-1 s: polling costs nothing worth a thread blocked in flock


class NodeLoadLock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / f".kubemoe-load-{os.geteuid()}.lock"
        self._told = False  # said once that the lock cannot be had

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the node's Load lock: waits (polling, so a cancelled wait leaves nothing behind) while
        another function holds it; holds nothing when its file cannot be opened."""
        try:  # not through a link someone else left in a shared folder
            fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            fd = None
            if not self._told:
                self._told = True
                log.warning("Loading without the node's Load lock: cannot open %s (%s); check --shm-dir",
                            self.path, e.strerror)
        if fd is None:
            yield
            return
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock


def node_load_lock(shm_dir: Path | None) -> NodeLoadLock | None:
    """The Load lock of a function's node: in its shared-memory folder; None without one (nothing to share it in)."""
    return NodeLoadLock(shm_dir) if shm_dir else None


def holding(lock: NodeLoadLock | None) -> AsyncContextManager[None]:
    """`lock` held, or nothing held without one."""
    return lock.held() if lock is not None else contextlib.nullcontext()
