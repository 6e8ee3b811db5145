"""The CPU reference linear is batch-invariant: a row's result does not depend on the rows beside it. The CPU
path's exactness rests on it (the batching, prefix-caching, preemption and chunked-prefill tests compare bits)."""
import pytest
import torch

from kernels.linear import ROW_BLOCK, linear_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: what the installer serves on CPUs
@pytest.mark.parametrize("k,n", [(576, 960), (576, 3072), (1536, 576)])  # the demo model's q/k/v, gate/up, down
def test_a_row_rounds_the_same_in_every_batch(k, n, dtype):
    torch.manual_seed(0)
    w, b, x = (torch.randn(n, k).to(dtype), torch.randn(n).to(dtype), torch.randn(300, k).to(dtype))
    rows = torch.cat([linear_ref(x[i:i + 1], w, b) for i in range(300)])  # each row alone
    assert rows.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(rows.float(), x.float() @ w.float().t() + b.float(), **tol)
    for m in (2, 7, 8, 9, ROW_BLOCK, 17, 64, 100, 192, 256, 300):
        assert torch.equal(linear_ref(x[:m], w, b), rows[:m]), f"a batch of {m} rows"
