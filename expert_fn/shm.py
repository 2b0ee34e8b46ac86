"""Same-node shared memory for expert calls: a ForwardStream's tensors through one mapped file.

Over loopback, gRPC in Python moves about 1 GB/s: a 64-token Mixtral call (512 KiB each way)
spends ~1 ms just crossing. A frontend and an expert function on the same node can share a tmpfs
folder instead (/dev/shm, or one hostPath mounted into both pods). The client writes a request's
hidden states into its segment and sends only the region's offset over the stream; the server
computes straight from the mapping and writes the reply over the same region. The gRPC call
itself is unchanged: ordering, deadlines, status codes and retries work as before.

The handshake (also in kubemoe.proto, at ExpertService): the client offers `<name>:<nonce>` in the
stream's metadata; the server maps the file, checks the nonce and says `attached` or
`refused: <why>` in its initial metadata; the client then unlinks the file. From then on the
memory lives exactly as long as the two mappings: nothing is left in the folder when either side
dies (only a client killed during the handshake leaves its file behind). A server on another node
(or pod without the shared folder) finds no such file and refuses: tensors then travel inline, as
before.

Who may attach what: the server opens only `kubemoe-<32 hex digits>` directly in its own folder,
a regular file (never a symlink, mode 0600) owned by its own user, whose first bytes are the nonce
the client sent. So a client can point the server only into a segment created by that same user,
never into any other file.

The folder itself (`shared_folder`): a missing one is created for this user alone (0700), which is how
pods get theirs inside the node's /dev/shm (kubemoe/pod_args.py: node_shm_dir); an existing one is used
when no other user can replace what is in it: it is this user's and nobody else may write in it, or it
is sticky like /dev/shm and /tmp (others may add files there, but never remove or rename ours).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
import secrets
import stat
import weakref
from pathlib import Path
from typing import Callable

import numpy
import torch

log = logging.getLogger(__name__)

METADATA_KEY = "kubemoe-shm"
ATTACHED = "attached"
REFUSED = "refused"
ALIGN = 64  # region offsets: a cache line, and a multiple of every dtype's size
HEADER_BYTES = 4096  # the nonce; data starts on the next page
NONCE_BYTES = 16
_NAME = re.compile(r"kubemoe-[0-9a-f]{32}")
# Views are made through numpy: 3-4x fewer microseconds than torch slicing and viewing, and a call
# makes one on each side. numpy has no bfloat16: its bits travel as int16 and are viewed back.
_NUMPY = {torch.float32: numpy.float32, torch.float16: numpy.float16, torch.bfloat16: numpy.int16}


class SharedMemoryError(Exception):
    """A segment could not be created or attached; the message says why (tensors then travel inline)."""


def shared_folder(folder: Path | None) -> Path | None:
    """`folder`, created for this user alone if it is missing, or None (with a warning saying why) when it
    cannot be used: segments then are neither offered nor attached, and tensors take the TCP lane."""
    if folder is None:
        return None
    try:
        try:
            os.mkdir(folder, 0o700)  # the parent must exist: a node's /dev/shm is, a typo is not created
        except FileExistsError:
            pass  # ours from an earlier start, the peer's (same user) from a moment ago, or someone else's
        info = os.lstat(folder)
    except OSError as e:
        log.warning("no shared memory in %s (%s): tensors take the TCP lane; check --shm-dir and its parent",
                    folder, e.strerror)
        return None
    sticky, open_to_others = info.st_mode & stat.S_ISVTX, info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not stat.S_ISDIR(info.st_mode):
        why = "it is not a directory (or is a symlink)"
    elif not sticky and info.st_uid != os.geteuid():
        why = f"it belongs to user {info.st_uid}, not to this process's {os.geteuid()}"
    elif not sticky and open_to_others:
        why = "others may write in it and it is not sticky (chmod 700 or chmod +t)"
    else:
        return folder
    log.warning("no shared memory in %s: %s; tensors take the TCP lane (remove the folder, or give it to "
                "this user, to share memory)", folder, why)
    return None


class Segment:
    """One mapped file: `view()` gives tensors over its regions, without copies."""

    def __init__(self, path: Path | None, buffer: mmap.mmap, nonce: bytes):
        self.path, self.nonce, self.size, self.buffer = path, nonce, len(buffer), buffer
        # Its views (numpy arrays over `buffer`, and this one) keep the mapping alive: it is unmapped
        # when the last one goes. This one also gives the mapping's address.
        self._bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self._address = self._bytes.data_ptr()
        self._pinned: bool | None = None  # None: pin() not tried yet

    @property
    def offer(self) -> str:
        """What the client sends as METADATA_KEY."""
        if self.path is None:  # private(): an arena that only a TCP lane reads into, never attached by name
            raise SharedMemoryError("a private arena has no file to offer: offer a segment made by create()")
        return f"{self.path.name}:{self.nonce.hex()}"

    @classmethod
    def create(cls, folder: str | Path, size: int) -> "Segment":
        """A new sparse file of `size` bytes in `folder` (tmpfs pages are only allocated once written)."""
        path = Path(folder) / f"kubemoe-{secrets.token_hex(16)}"
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise SharedMemoryError(f"cannot create a segment in {folder}: {e.strerror}") from None
        try:
            os.ftruncate(fd, HEADER_BYTES + size)
            buffer = mmap.mmap(fd, HEADER_BYTES + size)
        except OSError as e:
            os.unlink(path)
            raise SharedMemoryError(f"cannot map a {size}-byte segment in {folder}: {e.strerror}") from None
        finally:
            os.close(fd)
        buffer[:NONCE_BYTES] = nonce
        return cls(path, buffer, nonce)

    @classmethod
    def private(cls, size: int) -> "Segment":
        """Anonymous memory of this process laid out as a segment (data from HEADER_BYTES on, `size`
        bytes in all): the arena a TCP lane reads tensors into (frames.py). Pages come as written."""
        if not HEADER_BYTES < size:
            raise SharedMemoryError(f"an arena needs more than {HEADER_BYTES} bytes, got {size}")
        try:
            return cls(None, mmap.mmap(-1, size), b"")
        except OSError as e:
            raise SharedMemoryError(f"cannot map a {size}-byte arena: {e.strerror}") from None

    @classmethod
    def attach(cls, folder: str | Path, offer: str, *, max_bytes: int) -> "Segment":
        """Map the segment a client offered; raises SharedMemoryError saying why it may not be used."""
        name, _, nonce_hex = offer.partition(":")
        if not _NAME.fullmatch(name):
            raise SharedMemoryError(f"segment name {name[:80]!r} is not kubemoe-<32 hex digits>")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            nonce = b""
        if len(nonce) != NONCE_BYTES:
            raise SharedMemoryError(f"the nonce must be {2 * NONCE_BYTES} hex digits")
        path = Path(folder) / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:  # mostly ENOENT: the client is on another node, or sees another folder
            raise SharedMemoryError(f"no segment {name} in {folder} ({e.strerror}): not on this node's shared folder") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise SharedMemoryError(f"{path} is not a regular file owned by this server's user")
            if not HEADER_BYTES < info.st_size <= HEADER_BYTES + max_bytes:
                raise SharedMemoryError(f"segment of {info.st_size} bytes; this server maps at most {max_bytes}")
            buffer = mmap.mmap(fd, info.st_size)
        finally:
            os.close(fd)
        if buffer[:NONCE_BYTES] != nonce:
            raise SharedMemoryError(f"{name} does not hold the offered nonce")
        return cls(path, buffer, nonce)

    def unlink(self) -> None:
        """Remove the file; both mappings stay valid (the client does this once the server attached)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def view(self, offset: int, dtype: torch.dtype, shape: list[int], *,
             on_release: Callable[[], None] | None = None) -> torch.Tensor:
        """The tensor at `offset`; raises ValueError saying what is wrong when it does not fit.

        `on_release` runs once no view of the returned tensor is left (from whichever thread drops
        the last one)."""
        numel = 1
        for d in shape:
            numel *= d
        if offset % ALIGN or offset < HEADER_BYTES:
            raise ValueError(f"shared offset {offset} must be a multiple of {ALIGN} and at least {HEADER_BYTES}")
        if offset + numel * dtype.itemsize > self.size:
            raise ValueError(f"shared region of {numel * dtype.itemsize} bytes at offset {offset} ends past the "
                             f"segment ({self.size} bytes)")
        array = numpy.frombuffer(self.buffer, _NUMPY[dtype], numel, offset).reshape(shape)
        if on_release is not None:  # the tensor's storage, shared by all its views, holds `array`
            weakref.finalize(array, on_release)
        tensor = torch.from_numpy(array)
        return tensor.view(dtype) if dtype is torch.bfloat16 else tensor

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy `tensor` into the region at `offset` (which the caller allocated to fit it)."""
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            ctypes.memmove(self._address + offset, tensor.data_ptr(), tensor.nbytes)  # one memcpy, on this thread
        else:
            copy_into(self.view(offset, tensor.dtype, list(tensor.shape)), tensor)  # from a GPU, or gathered

    def pin(self) -> bool:
        """Register the mapping with CUDA, so host<->GPU copies of its regions are direct DMA (async).

        Tried once: later calls return the first outcome. It touches every page of the segment,
        which is allocated in full from then on."""
        if self._pinned is None:
            self._pinned = int(torch.cuda.cudart().cudaHostRegister(self._address, self.size, 0)) == 0
            if not self._pinned:  # e.g. a --shm-dir that is not tmpfs: copies then go through a bounce buffer
                # The failure stays CUDA's last error on this thread, where the next torch CUDA call
                # would raise it; a kernel launch's check reads (and so clears) it.
                with contextlib.suppress(RuntimeError):
                    torch.zeros(1, device="cuda")
        return self._pinned

    @property
    def tried_pinning(self) -> bool:
        return self._pinned is not None

    @property
    def pinned(self) -> bool:
        """Whether pin() succeeded (and unpin() has not undone it)."""
        return bool(self._pinned)

    def unpin(self) -> None:
        """Undo pin(); due before the mapping goes, which CUDA would otherwise keep registered."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self._pinned = False


def copy_into(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """dst.copy_(src), but as one memcpy on this thread when both are contiguous CPU tensors of one dtype.

    torch spreads a copy of more than 32K elements over its OpenMP threads; waking them costs
    more than the copy itself at expert-call sizes (a 512 KiB copy: 18 us alone, up to 170 us
    with the wake-ups, measured on 2 cores). `non_blocking` as in Tensor.copy_: the caller then
    synchronises before anyone reads `dst`.
    """
    if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
    else:
        dst.copy_(src, non_blocking=non_blocking)  # casts, or a DMA
    return dst


class Allocator:
    """Regions of a segment for the calls in flight: first fit, neighbours merged on free.

    Only a handful of regions are live at once (one per in-flight call of one stream), so plain
    lists are fast enough and easy to check.
    """

    def __init__(self, start: int, end: int):
        self._free: list[tuple[int, int]] = [(start, end)]  # sorted, disjoint, never adjacent
        self._used: dict[int, int] = {}  # offset -> end

    def alloc(self, nbytes: int) -> int | None:
        """An ALIGN-aligned offset with `nbytes` free after it, or None when nothing is large enough."""
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (start, end) in enumerate(self._free):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (start + nbytes, end)
                self._used[start] = start + nbytes
                return start
        return None

    def free(self, offset: int) -> None:
        start, end = offset, self._used.pop(offset)
        i = 0
        while i < len(self._free) and self._free[i][0] < start:
            i += 1
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free range
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # and with the previous one
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))

    def end(self, offset: int) -> int:
        """Where the region allocated at `offset` ends (`offset` itself when none is)."""
        return self._used.get(offset, offset)

    @property
    def in_use(self) -> int:
        return len(self._used)
