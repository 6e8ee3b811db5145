"""The CPU reference linear is batch-invariant: a row's result does not depend on the rows beside it. The CPU
path's exactness rests on it (the batching, prefix-caching, preemption and chunked-prefill tests compare bits)."""
import pytest
import torch

from kernels.linear import ROW_BLOCK, linear_ref


@pytest.mark.parametrize("k,n", [(576, 960), (576, 3072), (1536, 576)])  # the demo model's q/k/v, gate/up, down
def test_a_row_rounds_the_same_in_every_batch(k, n):
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(300, k)
    rows = torch.cat([linear_ref(x[i:i + 1], w, b) for i in range(300)])  # each row alone
    torch.testing.assert_close(rows, x @ w.t() + b, rtol=1e-4, atol=1e-3)
    for m in (2, 7, 8, 9, ROW_BLOCK, 17, 64, 100, 192, 256, 300):
        assert torch.equal(linear_ref(x[:m], w, b), rows[:m]), f"a batch of {m} rows"
