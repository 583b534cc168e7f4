import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run small models: one thread is faster than two fighting over shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
