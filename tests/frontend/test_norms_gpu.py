"""On a GPU (-m gpu): the one-kernel RMSNorm gives transformers' result in bfloat16, at most a unit in the
last place apart where the sums of squares round differently, and a fused norm takes the kernel."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from kubemoe.frontend.norms import fuse, rms_norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,width", [(1, 2048), (32, 2048), (256, 128), (7, 7168)])
def test_the_kernel_equals_transformers_rmsnorm_in_bfloat16(rows, width):
    g = torch.Generator(device="cuda").manual_seed(width)
    norm = Qwen3MoeRMSNorm(width, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, device="cuda", generator=g))
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    want, got = norm(x), rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)  # one bfloat16 unit in the last place
    assert (got != want).float().mean() < 0.01


def test_a_fused_norm_takes_the_kernel_on_the_gpu(monkeypatch):
    import kubemoe.frontend.norms as norms

    model = torch.nn.Sequential(Qwen3MoeRMSNorm(64)).to("cuda", torch.bfloat16)
    assert fuse(model) == 1
    calls = []
    monkeypatch.setattr(norms, "rms_norm", lambda *a: calls.append(a) or rms_norm(*a))
    model(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16))
    assert len(calls) == 1
