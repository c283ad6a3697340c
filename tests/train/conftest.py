"""Shared fixtures of the training tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors run fastest on one thread (and a busy CI box makes more threads spin). Tests
    that set their own thread count (train.num_threads) still do; this restores it after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
