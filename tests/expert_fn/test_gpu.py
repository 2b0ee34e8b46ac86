"""On a GPU (run with -m gpu on the lent H200): the CUDA path computes what the CPU does, inline and
through pinned shared memory, from CPU and from CUDA hidden states."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from kubemoe.expert_fn.shm import Segment
from kubemoe.verify import rel_err

pytestmark = pytest.mark.gpu

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
LAYER, EXPERTS, COUNTS = 1, [0, 5, 7], [4, 5, 1]


@pytest.fixture
def tmpfs():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        yield Path(folder)


def test_a_tmpfs_segment_pins_and_a_failed_pin_leaves_cuda_usable(tmpfs, tmp_path):
    segment = Segment.create(tmpfs, 1 << 20)
    assert segment.pin()  # /dev/shm, as kubemoe serves by default: copies are direct DMA
    segment.unpin()
    elsewhere = Segment.create(tmp_path, 1 << 20)  # on a disk file system CUDA refuses to register it
    elsewhere.pin()
    assert torch.ones(2, device="cuda").sum().item() == 2  # whatever the outcome, no CUDA error lingers
    elsewhere.unpin()
    segment.unlink(), elsewhere.unlink()


@pytest.mark.parametrize("folder", ["tmpfs", "tmp_path"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
async def test_a_cuda_expert_function_matches_the_cpu_one(dtype, tolerance, folder, tiny_checkpoint, serve, request):
    tmp_path = request.getfixturevalue(folder)  # a pinned segment, and one that may not pin
    checkpoint = tiny_checkpoint(ARCH)
    x = torch.randn(sum(COUNTS), 128, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    async with serve(checkpoint, dtype=dtype) as cpu:
        client = cpu.client(streaming=False)
        want = await client.forward(LAYER, EXPERTS, COUNTS, x)
        await client.close()
    async with serve(checkpoint, dtype=dtype, device="cuda", shm_dir=tmp_path) as gpu:
        for transport, options in {"unary": dict(streaming=False), "stream": {}, "shm": dict(shm_dir=tmp_path)}.items():
            client = gpu.client(**options)
            got = await client.forward(LAYER, EXPERTS, COUNTS, x)
            assert rel_err(got.float(), want.float()) < tolerance, transport
            from_cuda = await client.forward(LAYER, EXPERTS, COUNTS, x.cuda())
            assert from_cuda.device.type == "cuda" and torch.equal(from_cuda.cpu(), got), transport
            assert client.shared_memory == (transport == "shm")
            await client.close()
