"""On a GPU (-m gpu, the lent H200): flags in device memory hand work from one stream to another, queued
and replayed in CUDA graphs, both ways a stream can wait (expert_fn/gpu_flags.py); across processes
they run in tests/frontend/test_device_link_gpu.py and benchmarks/experiments/step_flags_probe.py."""

from __future__ import annotations

import time

import pytest
import torch

from kubemoe.expert_fn import gpu_flags

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spin", [False, True], ids=["memory-operations", "spinning-kernel"])
def test_a_captured_stream_waits_for_a_flag_another_stream_sets_and_hands_one_back(spin):
    flags = gpu_flags.Flags(torch.device("cuda"), spin=spin)
    go, done = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    x = torch.zeros(1, device="cuda")
    waiter, setter = torch.cuda.Stream(), torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(waiter):
        graph.capture_begin(capture_error_mode="thread_local")
        flags.wait(go)
        x.add_(1)
        flags.signal(done)
        graph.capture_end()
    for step in range(1, 4):
        with torch.cuda.stream(waiter):
            graph.replay()
        finished = torch.cuda.Event()
        finished.record(waiter)
        time.sleep(0.05)
        assert not finished.query()  # it waits for go, which nobody set yet
        with torch.cuda.stream(setter):
            flags.signal(go)
            flags.wait(done)
        setter.synchronize()
        assert finished.query() and x.item() == step
        assert go.item() == 0 and done.item() == 0  # each wait consumed its flag: the next replay waits again


def test_a_wait_nobody_will_signal_is_released_from_the_host():
    flags = gpu_flags.Flags(torch.device("cuda"))
    stuck = torch.zeros(3, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            flags.wait(stuck[i:i + 1])
    time.sleep(0.05)
    assert not stream.query()
    gpu_flags.release(stuck)
    stream.synchronize()
    assert stuck.tolist() == [0, 0, 0]
    assert isinstance(gpu_flags.mps_enabled(torch.device("cuda")), bool)
