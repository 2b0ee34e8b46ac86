"""Same-node shared memory: the handshake, exact results, fallbacks, and bad regions refused."""

from __future__ import annotations

import asyncio
import gc
import os

import grpc
import pytest
import torch

from kubemoe import wire
from kubemoe.expert_fn.client import ExpertClient
from kubemoe.expert_fn.shm import (ALIGN, HEADER_BYTES, METADATA_KEY, Allocator, Segment, SharedMemoryError,
                                   shared_folder)
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc
from kubemoe.verify import rel_err

from .conftest import left_in

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
H = 128


# -- the allocator (pure) ---------------------------------------------------------------------------

def test_allocator_reuses_freed_regions_and_merges_neighbours():
    a = Allocator(4096, 4096 + 1000 * ALIGN)
    x, y, z = a.alloc(100), a.alloc(ALIGN), a.alloc(10 * ALIGN)
    assert (x, y, z) == (4096, 4096 + 2 * ALIGN, 4096 + 3 * ALIGN)  # rounded up to ALIGN, first fit
    assert a.alloc(1000 * ALIGN) is None  # larger than what is left
    a.free(y)
    assert a.alloc(ALIGN) == y  # the hole is reused
    a.free(x), a.free(y), a.free(z)
    assert a.in_use == 0
    assert a.alloc(1000 * ALIGN) == 4096  # all three merged back into one range


def test_allocator_frees_in_any_order():
    a = Allocator(0, 64 * ALIGN)
    regions = [a.alloc(ALIGN) for _ in range(64)]
    assert a.alloc(1) is None
    for offset in regions[1::2] + regions[::2]:
        a.free(offset)
    assert a.alloc(64 * ALIGN) == 0


# -- segments ---------------------------------------------------------------------------------------

def test_a_segment_is_private_to_its_user_and_attaches_with_its_nonce(tmp_path):
    seg = Segment.create(tmp_path, 1 << 20)
    assert os.stat(seg.path).st_mode & 0o777 == 0o600
    seg.view(HEADER_BYTES, torch.float32, [4]).copy_(torch.arange(4.0))
    peer = Segment.attach(tmp_path, seg.offer, max_bytes=1 << 20)
    assert torch.equal(peer.view(HEADER_BYTES, torch.float32, [4]), torch.arange(4.0))  # the same memory
    seg.unlink()
    assert not any(tmp_path.iterdir())
    assert torch.equal(peer.view(HEADER_BYTES, torch.float32, [4]), torch.arange(4.0))  # still mapped


@pytest.mark.parametrize("case, words", [
    ("wrong nonce", "does not hold the offered nonce"),
    ("bad name", "is not kubemoe-<32 hex digits>"),
    ("path in name", "is not kubemoe-<32 hex digits>"),
    ("missing file", "not on this node's shared folder"),
    ("symlink", "not on this node's shared folder"),
    ("too large", "maps at most"),
])
def test_attach_refuses_what_the_client_did_not_create(case, words, tmp_path):
    seg = Segment.create(tmp_path, 1 << 20)
    name, nonce = seg.offer.split(":")
    offer = {
        "wrong nonce": f"{name}:{'0' * 32}",
        "bad name": f"secrets:{nonce}",
        "path in name": f"../{name}:{nonce}",
        "missing file": f"kubemoe-{'a' * 32}:{nonce}",
        "symlink": f"kubemoe-{'b' * 32}:{nonce}",
        "too large": seg.offer,
    }[case]
    (tmp_path / f"kubemoe-{'b' * 32}").symlink_to(seg.path)
    with pytest.raises(SharedMemoryError, match=words):
        Segment.attach(tmp_path, offer, max_bytes=1 << 10 if case == "too large" else 1 << 20)


# -- the folder (a pod's in the node's /dev/shm) -------------------------------------------------------

def test_a_missing_folder_is_made_for_this_user_alone_and_then_shared_by_its_peers(tmp_path):
    folder = tmp_path / "node-shm" / "kubemoe-uid-1"
    folder.parent.mkdir()
    folder.parent.chmod(0o1777)  # as a node's /dev/shm
    assert shared_folder(folder) == folder
    info = folder.stat()
    assert oct(info.st_mode & 0o7777) == oct(0o700) and info.st_uid == os.geteuid()
    assert shared_folder(folder) == folder  # the second pod on the node finds it made
    segment = Segment.create(folder, 1 << 16)
    assert Segment.attach(folder, segment.offer, max_bytes=1 << 16).nonce == segment.nonce
    assert shared_folder(None) is None


def test_a_sticky_folder_of_anyone_is_used_as_is(tmp_path):
    sticky = tmp_path / "shm"
    sticky.mkdir()
    sticky.chmod(0o1777)
    if os.geteuid() == 0:
        os.chown(sticky, 12345, 12345)  # root's /dev/shm, for a non-root pod
    assert shared_folder(sticky) == sticky


@pytest.mark.parametrize("case, words", [
    ("open-to-others", "others may write in it and it is not sticky"),
    ("another-users", "it belongs to user 12345"),
    ("a-file", "not a directory"),
    ("a-symlink", "not a directory"),
    ("no-parent", "No such file or directory"),
])
def test_a_folder_another_user_could_swap_segments_in_is_not_used(tmp_path, caplog, case, words):
    folder = tmp_path / "kubemoe-uid-1"
    if case == "open-to-others":
        folder.mkdir()
        folder.chmod(0o777)
    elif case == "another-users":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        folder.mkdir(0o700)
        os.chown(folder, 12345, 12345)  # made first by a pod of another user
    elif case == "a-file":
        folder.write_text("")
    elif case == "a-symlink":
        (tmp_path / "elsewhere").mkdir(0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder = tmp_path / "missing" / "kubemoe-uid-1"
    assert shared_folder(folder) is None
    assert words in caplog.text and "tensors take the TCP lane" in caplog.text


def test_views_outside_the_segment_are_refused(tmp_path):
    seg = Segment.create(tmp_path, 1 << 12)
    with pytest.raises(ValueError, match="ends past the segment"):
        seg.view(HEADER_BYTES, torch.float32, [1 << 11])
    with pytest.raises(ValueError, match="multiple of 64"):
        seg.view(HEADER_BYTES + 4, torch.float32, [1])
    with pytest.raises(ValueError, match="at least 4096"):
        seg.view(0, torch.float32, [1])  # the header (nonce) is not data


# -- over a real channel ----------------------------------------------------------------------------

@pytest.fixture
async def shm_server(tiny_checkpoint, serve, tmp_path):
    async with serve(tiny_checkpoint(ARCH), shm_dir=tmp_path) as running:
        yield running


async def test_a_reply_dropped_on_another_thread_frees_its_region_at_the_streams_next_call(shm_server, tmp_path):
    """A frontend's model thread drops a layer's replies: their regions are freed by the stream's next
    call, on the loop, without a wake-up of the loop's thread for each."""
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(0))
    client = shm_server.client(shm_dir=tmp_path)
    held = [await client.forward(1, [3], [8], x)]
    want = held[0].clone()
    await asyncio.to_thread(held.clear)  # the last view goes on another thread
    for _ in range(3):
        await asyncio.sleep(0)
    assert client._stream.allocator.in_use == 1 and len(client._stream.freed_elsewhere) == 1  # not freed yet
    again = await client.forward(1, [3], [8], x)
    assert client._stream.allocator.in_use == 1 and not client._stream.freed_elsewhere  # the old region went first
    assert torch.equal(again, want)
    await client.close()


async def test_tensors_go_through_shared_memory_with_the_inline_results(shm_server, tmp_path):
    xs = [torch.randn(n, H, generator=torch.Generator().manual_seed(n)) for n in (1, 5, 17, 64)]
    inline = shm_server.client()
    want = [await inline.forward(1, [n % 8, 7], [len(x) - 1, 1], x) for n, x in enumerate(xs)]
    client = shm_server.client(shm_dir=tmp_path)
    got = await asyncio.gather(*(client.forward(1, [n % 8, 7], [len(x) - 1, 1], x) for n, x in enumerate(xs)))
    assert client.shared_memory
    # Concurrent calls may merge into one matmul per expert, whose rounding differs from one row alone.
    assert all(rel_err(g, w) < 1e-6 for g, w in zip(got, want))
    assert not left_in(tmp_path)  # the client removed the file once the server had mapped it
    assert shm_server.metrics.value("shared_memory_streams_total", result="attached") == 1
    assert client._stream.allocator.in_use == len(xs)  # each reply still lies in its region, held by `got`
    halves = [g.split([1, len(g) - 1]) for g in got]
    del got
    gc.collect()
    await asyncio.sleep(0)
    assert client._stream.allocator.in_use == len(xs)  # views of the replies keep their regions
    del halves
    gc.collect()
    await asyncio.sleep(0)
    assert client._stream.allocator.in_use == 0  # freed once no view is left
    got_again = [await client.forward(1, [n % 8, 7], [len(x) - 1, 1], x) for n, x in enumerate(xs)]
    assert all(torch.equal(g, w) for g, w in zip(got_again, want))  # one at a time, as `want`; in reused regions
    await client.close()
    await inline.close()


async def test_a_call_larger_than_the_segment_goes_through_it_in_parts(shm_server, tmp_path, placed):
    """A long prefill's call: cut into parts of half the segment, two in flight, none inline (inline is
    what a call that finds no free region falls back to: a region held elsewhere)."""
    client = shm_server.client(shm_dir=tmp_path, shm_bytes=16 * H * 4)  # room for 16 tokens
    x = torch.randn(40, H)
    big = await client.forward(0, [2, 5], [25, 15], x)
    assert client.shared_memory and placed == [(8, True)] * 5
    held = await client.forward(0, [1], [8], x[:8])  # its reply, still viewed, keeps half the segment
    late = await client.forward(0, [3], [16], x[:16])  # 2 parts: one finds no free region and travels inline
    assert sorted(placed[6:]) == [(8, False), (8, True)]
    inline = shm_server.client(streaming=False)
    # Close, not bitwise: a part's 8 rows and the whole call's 25 meet GEMM kernels blocked differently
    # (on AVX-512 the last bits differ).
    torch.testing.assert_close(big, await inline.forward(0, [2, 5], [25, 15], x))
    torch.testing.assert_close(held, await inline.forward(0, [1], [8], x[:8]))
    torch.testing.assert_close(late, await inline.forward(0, [3], [16], x[:16]))
    await client.close()
    await inline.close()


async def test_a_server_without_the_folder_refuses_and_tensors_travel_inline(tiny_checkpoint, serve, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for shm_dir in (None, other):  # no --shm-dir; a folder the client does not share (another node)
        async with serve(tiny_checkpoint(ARCH), shm_dir=shm_dir) as server:
            client = server.client(shm_dir=tmp_path)
            x = torch.randn(3, H)
            got = await client.forward(1, [2], [3], x)
            assert not client.shared_memory
            assert not any(tmp_path.glob("kubemoe-*"))  # the refused segment is gone too
            assert torch.equal(got, await server.client(streaming=False).forward(1, [2], [3], x))
            assert server.metrics.value("shared_memory_streams_total", result="refused") == 1
            await client.close()


async def test_bad_shared_regions_are_refused_and_the_server_keeps_serving(shm_server, tmp_path):
    seg = Segment.create(tmp_path, 1 << 16)
    async with grpc.aio.insecure_channel(shm_server.address) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        call = stub.ForwardStream(metadata=((METADATA_KEY, seg.offer),))
        assert dict(await call.initial_metadata())[METADATA_KEY] == "attached"
        for offset, words in ((1 << 20, "ends past the segment"), (HEADER_BYTES + 8, "multiple of 64"),
                              (HEADER_BYTES, None)):  # then a good one, on the same stream
            req = pb.ForwardRequest(model=shm_server.config.model, request_id=str(offset), layer=0, experts=[1],
                                    counts=[2])
            wire.describe_shared(req.hidden, torch.float32, [2, H], offset)
            await call.write(req)
            response = await call.read()
            assert response.request_id == req.request_id
            if words is None:
                assert not response.HasField("error") and response.hidden == req.hidden
            else:
                assert response.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert words in response.error.message
        await call.done_writing()
        req = pb.ForwardRequest(model=shm_server.config.model, request_id="unary", layer=0, experts=[1], counts=[2])
        wire.describe_shared(req.hidden, torch.float32, [2, H], HEADER_BYTES)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Forward(req)  # a unary call has no segment
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no segment attached" in refused.value.details()
    seg.unlink()
    client = shm_server.client(shm_dir=tmp_path)
    assert (await client.forward(1, [6], [4], torch.randn(4, H))).shape == (4, H)
    assert client.shared_memory
    await client.close()


class InlineReplies(pb_grpc.ExpertServiceServicer):
    """Attaches the offered segment, then (wrongly) answers shared-memory requests with inline bytes."""

    def __init__(self, folder):
        self.folder = folder

    async def ForwardStream(self, request_iterator, context):
        offer = dict(context.invocation_metadata())[METADATA_KEY]
        segment = Segment.attach(self.folder, offer, max_bytes=1 << 30)
        await context.send_initial_metadata(((METADATA_KEY, "attached"),))
        async for request in request_iterator:
            x = wire.decode(request.hidden, segment)
            yield pb.ForwardResponse(request_id=request.request_id, hidden=wire.encode(x))


async def test_a_reply_that_does_not_come_back_the_way_it_was_sent_is_data_loss(tmp_path):
    server = grpc.aio.server()
    pb_grpc.add_ExpertServiceServicer_to_server(InlineReplies(tmp_path), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ExpertClient(f"127.0.0.1:{port}", model="m", shm_dir=tmp_path)
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await client.forward(0, [0], [2], torch.randn(2, H))
    assert lost.value.code() == grpc.StatusCode.DATA_LOSS and "inline, not the way it was sent" in lost.value.details()
    assert client._stream.allocator.in_use == 0  # its region is free again
    await client.close()
    await server.stop(None)


def test_a_private_arena_has_no_name_to_offer():
    arena = Segment.private(HEADER_BYTES + (1 << 12))  # a TCP lane's arena: this process's own memory
    with pytest.raises(SharedMemoryError, match="no file to offer"):
        _ = arena.offer
