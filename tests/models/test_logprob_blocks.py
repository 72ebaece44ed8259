"""The torch reference of the LM head's log-prob on a CPU runs in row blocks (fastcredit.models.logprob): the same
values and gradients as the whole-matrix reference, the blocks' LM-head gradients added up."""
import pytest
import torch

from fastcredit.kernels.linear_logprob.naive import linear_logprob_naive
from fastcredit.models import logprob as L


@pytest.mark.parametrize("N", [1, L.CPU_BLOCK_ROWS, 2 * L.CPU_BLOCK_ROWS + 37])
def test_blocks_give_the_whole_matrix_values_and_gradients(N):
    g = torch.Generator().manual_seed(N)
    H, V = 24, 301
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (0.2 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_(True)
    t = torch.randint(-1, V, (N,), generator=g)  # -1: a position with no target, logp 0 there
    up_lp, up_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda *a: L.linear_logprob(*a, impl="torch"), linear_logprob_naive):
        lp, ent = fn(h, w, t, 0.7)
        dh, dw = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (h, w))
        grads.append((lp, ent, dh, dw))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (grads[0][0][t < 0] == 0).all()
