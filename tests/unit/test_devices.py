"""Process-wide device choices made where a process decides how it serves."""

import torch

from kubemoe.devices import serving_attention


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
