"""The device link's contract on CPU: its packets and flags, whose rows are whose, and a server that cannot
link saying so. The link itself (CUDA IPC, flags in device memory) runs in tests/frontend/test_device_link_gpu.py."""

from __future__ import annotations

import select
import socket
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

from kubemoe.expert_fn import device_link
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.lane import socket_address
from kubemoe.expert_fn.server import build_server
from kubemoe.frontend.loop_thread import LoopThread
from kubemoe.expert_fn.store import LayerStack
from kubemoe.moe import StackedExperts, sort_pairs, sorted_ffn
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc


def test_a_step_packet_round_trips_and_a_bad_one_says_what_is_wrong():
    layers = (1, 3, 5)
    packet = device_link.pack_step(96, {5: [0, 3, 9], 1: [2]}, 10)
    assert len(packet) == device_link.max_packet_bytes(2, 10) <= device_link.max_packet_bytes(len(layers), 10)
    assert device_link.unpack_step(packet, 10, 128, layers) == (96, {5: [0, 3, 9], 1: [2]})  # in the step's order
    with pytest.raises(ValueError, match="2 layers of this model is 20 bytes, got 19"):
        device_link.unpack_step(packet[:-1], 10, 128, layers)
    with pytest.raises(ValueError, match="rows 96 must be 1..64"):
        device_link.unpack_step(packet, 10, 64, layers)
    with pytest.raises(ValueError, match="beyond the model's 10"):
        device_link.unpack_step(packet[:-1] + bytes([0b100]), 10, 128, layers)
    with pytest.raises(ValueError, match="layer 1 names no expert"):
        device_link.unpack_step(device_link.pack_step(96, {1: []}, 10), 10, 128, layers)
    with pytest.raises(ValueError, match="layer 2 is not an MoE layer"):
        device_link.unpack_step(device_link.pack_step(96, {2: [1]}, 10), 10, 128, layers)
    with pytest.raises(ValueError, match="at least one layer"):
        device_link.unpack_step(device_link.pack_step(96, {}, 10), 10, 128, layers)
    assert device_link.mask_experts(device_link.experts_mask([1, 8, 15], 16), 16) == [1, 8, 15]


def test_a_links_flags_are_each_layers_go_and_done_then_void():
    flags = torch.arange(device_link.flag_count(4))
    assert [device_link.go_flag(flags, 3).item(), device_link.done_flag(flags, 3).item(),
            device_link.void_flag(flags).item()] == [3, 7, 8]


def test_each_side_computes_only_its_experts_rows_and_together_they_equal_the_whole_layer():
    """Six experts, two functions ({0, 2, 3} and {1, 4, 5}), a batch with spare rows (a graph's padding):
    each writes its rows' outputs at their rows of the shared `out` and the rest to the scratch row;
    both done, `out` holds the layer computed over one stack, and the spare rows what they held."""
    gen = torch.Generator().manual_seed(0)
    T, K, H, I, E = 7, 2, 16, 8, 6
    stack = StackedExperts(torch.randn(E, 2 * I, H, generator=gen) / 4, torch.randn(E, H, I, generator=gen) / 4)
    hidden = torch.randn(T, H, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    pairs = sort_pairs(hidden, index, weights, E, False, real_rows=torch.tensor(5))  # rows 5, 6: spare
    rows = pairs.x.shape[0]
    whole = sorted_ffn(pairs.x, pairs.ends[:E], stack, F.silu)
    groups = device_link.row_groups(pairs.ends, rows)
    assert groups[-2 * K:].tolist() == [E] * (2 * K)  # the spare rows' pairs: the group after the experts'
    out = torch.full((rows + 1, H), 7.0)  # shared by both
    for held in ([0, 2, 3], [1, 4, 5]):
        local = StackedExperts(stack.gate_up[held], stack.down[held])
        table = device_link.expert_table({e: i for i, e in enumerate(held)}, E + 1, torch.device("cpu"))
        assert table.tolist()[E:] == [-1, -1]  # the spare group's and anything past it: nobody's
        before = out.clone()
        device_link.run_owned(pairs.x, pairs.ends, table, local, F.silu, out)
        own = table[groups] >= 0
        torch.testing.assert_close(out[:rows][own], whole[own])
        assert torch.equal(out[:rows][~own], before[:rows][~own])  # the others' rows untouched
    real = groups < E
    torch.testing.assert_close(out[:rows][real], whole[real])
    assert (out[:rows][~real] == 7.0).all()  # no function wrote the spare rows


def test_a_server_without_a_gpu_refuses_to_link_and_keeps_serving(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    loop = LoopThread("expert-server")
    config = ExpertFnConfig.build(path, "0:0-1", device="cpu", metrics_port=None, shm_dir=tmp_path)
    built = loop.run(build_server("127.0.0.1:0", config))
    loop.run(built.server.start())
    try:
        async def attach_then_describe():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
                stub = pb_grpc.ExpertServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.AttachDevice(pb.DeviceAttachRequest(model=config.model, gpu_uuid="GPU-0"))
                with pytest.raises(grpc.aio.AioRpcError) as wrong_model:
                    await stub.AttachDevice(pb.DeviceAttachRequest(model="other"))
                return refused.value, wrong_model.value, await stub.Describe(pb.DescribeRequest())

        refused, wrong_model, described = loop.run(attach_then_describe())
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "send tensors on ForwardStream" in refused.details()
        assert wrong_model.code() == grpc.StatusCode.NOT_FOUND
        assert described.model == config.model
    finally:
        loop.run(built.stop(0))
        loop.stop()


def _connect(link: device_link.ServerLink) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with socket_address(link.path) as address:
        sock.connect(address)
    sock.settimeout(10)
    return sock


def _ends(sock: socket.socket) -> bool:
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def _wait_closed(link: device_link.ServerLink) -> bool:
    deadline = time.monotonic() + 10
    while not link.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return link.closed


def test_a_link_serves_the_client_with_its_token_alone_and_refuses_a_step_it_cannot_run(tmp_path):
    """The socket (no GPU needed): a client with a wrong token is refused and the link ends; the right
    one gets each step packet answered, with why where the function cannot run it (a packet outside the
    protocol, experts it lacks, no GPU), and the socket file is gone from the folder once a client connected."""
    stacks = {3: LayerStack(StackedExperts(torch.zeros(2, 4, 4), torch.zeros(2, 4, 2)), {1: 0, 2: 1})}

    def link() -> device_link.ServerLink:
        return device_link.ServerLink(tmp_path, torch.zeros(8, 4), torch.zeros(5, dtype=torch.int32),
                                      torch.zeros(9, 4), torch.zeros(device_link.flag_count(6), dtype=torch.int32),
                                      4, (1, 3, 5), stacks.get, F.silu, None)

    wrong = link()
    with _connect(wrong) as sock:
        sock.send(bytes(device_link.TOKEN_BYTES))
        assert _ends(sock) and _wait_closed(wrong)
    right = link()
    with _connect(right) as sock:
        sock.send(right.token)
        answers = []
        for packet in (device_link.pack_step(9, {3: [1]}, 4), device_link.pack_step(6, {3: [0, 1], 5: [2]}, 4),
                       device_link.pack_step(6, {3: [1, 2]}, 4)):
            sock.send(packet)
            answers.append(sock.recv(1024))
        assert not right.path.exists()  # gone once the server accepted (it answered: it had)
    assert [a[0] for a in answers] == [device_link.REFUSED] * 3
    assert b"rows 9 must be 1..8" in answers[0]
    assert b"lacks experts [0] of layer 3" in answers[1]
    assert b"device links need a GPU" in answers[2]
    assert _wait_closed(right) and not list(tmp_path.iterdir())


def test_the_owned_rows_kernel_computes_what_the_torch_steps_compute_under_tritons_interpreter(triton_interpreted):
    """On a GPU owned_rows is one kernel (`moe_kernels.runs_here`): under Triton's CPU interpreter it gives
    the torch steps' src, dst and local ends, for functions holding some experts, none of a layer's, or
    all, with spare rows and empty experts."""
    triton_interpreted("""
        import torch
        from kubemoe import moe_kernels
        from kubemoe.expert_fn import device_link
        g = torch.Generator().manual_seed(0)
        for experts, tokens, k, held in ((6, 7, 2, [0, 2, 3]), (6, 7, 2, [1, 4, 5]), (8, 1, 2, [7]),
                                         (128, 32, 8, list(range(0, 128, 3))), (16, 40, 4, list(range(16))),
                                         (8, 3, 2, [])):
            chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
            spare = torch.arange(chosen.shape[0]) >= (tokens - 1) * k  # the last token's pairs: a graph's padding
            chosen = torch.where(spare, experts, chosen)
            ends = torch.zeros(experts + 1, dtype=torch.int64).index_add_(0, chosen, torch.ones_like(chosen))
            ends = ends.cumsum(0).to(torch.int32)
            rows = chosen.shape[0]
            table = device_link.expert_table({e: i for i, e in enumerate(held)}, experts + 1, torch.device("cpu"))
            local = max(len(held), 1)
            moe_kernels.runs_here = lambda device: False
            want = device_link.owned_rows(ends, rows, table, local, rows)
            moe_kernels.runs_here = lambda device: True
            got = device_link.owned_rows(ends, rows, table, local, rows)
            for w, o in zip(want, got):
                assert w.dtype == o.dtype and torch.equal(w, o), (experts, held, w, o)
        print("equal")
    """)


def test_the_frontend_sees_at_once_that_a_function_ended_its_link(tmp_path):
    """What lets a step whose function went away mid-step end within a millisecond, not at the timeout
    (StepLinks._wait_end): the client's socket reads as closed, found without waiting."""
    server = device_link.ServerLink(tmp_path, torch.zeros(8, 4), torch.zeros(5, dtype=torch.int32), torch.zeros(9, 4),
                                    torch.zeros(device_link.flag_count(2), dtype=torch.int32), 4, (0, 1),
                                    lambda layer: None, F.silu, None)
    client = device_link.ClientLink(tmp_path, pb.DeviceAttachResponse(socket=server.path.name, token=server.token),
                                    torch.zeros(device_link.flag_count(2), dtype=torch.int32))
    try:
        client.send(device_link.pack_step(4, {1: [2]}, 4))
        assert _until(lambda: bool(select.select([client.sock], [], [], 0)[0]))
        assert not client.closed()  # an answer waiting is not an end, and asking reads nothing
        with pytest.raises(device_link.LinkError, match="lacks experts"):
            client.receive(10)  # served: the connection is up
        assert not client.closed()
        server.close()
        deadline = time.monotonic() + 10
        while not client.closed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.closed()
        with pytest.raises(device_link.LinkError, match="closed it"):
            client.receive(10)
    finally:
        client.close()


class _End:
    done = False

    def query(self) -> bool:
        return self.done


class _Link:
    gone = False

    def closed(self) -> bool:
        return self.gone


def _until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_watchdog_releases_a_replay_in_flight_whose_function_left_or_that_outlived_its_deadline(monkeypatch):
    """Behind a linked replay in flight anything may wait for the GPU: the watchdog releases the waits of
    a link that failed it, of a link whose function closed it, then, past the deadline, of every link,
    once each, marking each replay failed for its finish; a replay that ended is left alone."""
    monkeypatch.setattr(device_link, "WATCH_SECONDS", 0.005)
    released: list[str] = []
    a, b = _Link(), _Link()
    flight = device_link.InFlight({"a": a, "b": b}, timeout=0.5, release=released.append)
    ends = [_End(), _End(), _End()]
    for end, failed in zip(ends, ({}, {"b": "refused"}, {})):
        flight.add(failed)
        flight.launched(end)
    ends[2].done = True  # this one ended before anything went wrong
    assert _until(lambda: len(released) == 1)
    time.sleep(0.05)
    assert released == ["b"] and flight.busy()  # the second's b, whose packet was refused, and nothing else
    a.gone = True
    assert _until(lambda: len(released) == 3)
    assert released == ["b", "a", "a"]  # the two replays still running, once each
    assert _until(lambda: len(released) == 4)  # past the deadline: the first's b
    assert released == ["b", "a", "a", "b"]
    first, second, third = flight.pop(), flight.pop(), flight.pop()
    assert first.failed == {"a": "the expert function closed the link during the step",
                            "b": "the step did not finish in 0.5 s"}
    assert second.failed == {"b": "refused", "a": "the expert function closed the link during the step"}
    assert third.failed == {} and not flight.busy()
