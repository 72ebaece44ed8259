"""Shared by the credit tests."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads only add synchronisation (slow on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
