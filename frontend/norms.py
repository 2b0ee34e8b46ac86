"""RMSNorm as one kernel on a GPU, for the models whose RMSNorm is Llama's.

`transformers`' RMSNorm runs as seven or eight kernels (a cast to float32, pow, mean, add, rsqrt, two
multiplies, a cast back): at decode sizes each is a launch of a few microseconds for a few kilobytes,
and Qwen3-30B-A3B has four norms per layer (input, post-attention, the query's and the key's), so in a
CUDA-graph decode pass they took about as long as the layer's attention (issue 17,
decode_step_probe.py). Here one Triton program normalises one row, with the same steps in the same
precision: float32 statistics, the normalised row rounded to the input's dtype, then times the weight.
The sum of squares is reduced in another order than torch's mean, so a result can differ from
transformers' in the last bit of a bfloat16.

Only the classes listed in LLAMA_FORMULA are fused: their forward is exactly that formula
(`tests/frontend/test_norms.py` checks each against the kernel). Elsewhere, off the GPU, and inside a
pass that TorchDynamo compiles (where Inductor fuses the norm itself), the module's own forward runs.
"""

from __future__ import annotations

import functools

import torch

from kubemoe.frontend import fusion

# transformers' RMSNorm classes whose forward is: float32, x * rsqrt(mean(x^2) + eps), back to the input's
# dtype, weight * that.
LLAMA_FORMULA = frozenset({"MixtralRMSNorm", "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "DeepseekV2RMSNorm",
                           "DeepseekV3RMSNorm", "OlmoeRMSNorm", "Glm4MoeRMSNorm"})


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=live)

    return rms_norm_kernel



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * (x / rms(x)) as the LLAMA_FORMULA classes compute it, in one kernel."""
    import triton

    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _kernel()[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                    BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)
    return out.view(*x.shape[:-1], n)


def fuse(model: torch.nn.Module) -> int:
    """Give every LLAMA_FORMULA norm of `model` the one-kernel forward (it falls back to its own off the
    GPU); returns how many."""
    return fusion.swap_forward(model, LLAMA_FORMULA, lambda norm, x: rms_norm(x, norm.weight, norm.variance_epsilon))
