"""Process-wide device choices made where a process decides how it serves."""

import torch

from kubemoe.devices import graph_pool, serving_attention


def test_serving_on_a_gpu_turns_cudnn_attention_off_and_on_the_cpu_leaves_it():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        serving_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        serving_attention(torch.device("cuda"))  # a flag: set without a GPU present
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_graph_pool_is_kept_while_graphs_hold_it_and_made_anew_once_none_does(monkeypatch):
    made = iter([(0, 1), (0, 2)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(made))
    pool = graph_pool(None, held=False)  # the first capture
    assert pool == (0, 1) and graph_pool(pool, held=True) is pool
    assert graph_pool(pool, held=False) == (0, 2)  # every graph of it retired: it may be gone


def test_emptying_the_cache_waits_for_a_graph_capture_on_another_thread(monkeypatch):
    """PyTorch's allocator fails an assertion when its cache is emptied during a capture: an expert function's
    store gives memory back from a thread of its own while rounds may capture, so the two take turns."""
    import threading
    import time

    from kubemoe.devices import CAPTURING, empty_cache

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(time.monotonic()))
    capturing, released = threading.Event(), []

    def capture():
        with CAPTURING:
            capturing.set()
            time.sleep(0.2)
            released.append(time.monotonic())

    capturer = threading.Thread(target=capture)
    capturer.start()
    capturing.wait()
    empty_cache()
    capturer.join()
    assert len(emptied) == 1 and emptied[0] >= released[0]
    with CAPTURING:  # the capturing thread itself may empty it between captures (a capture out of memory)
        empty_cache()
    assert len(emptied) == 2
