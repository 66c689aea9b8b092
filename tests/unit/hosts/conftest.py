"""One torch thread for the server tests: the models are tiny, and on a shared few-core
machine OpenMP threads competing with other processes make each forward ~100x slower."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
