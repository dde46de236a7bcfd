import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two threads everywhere: CI has two cores, and a fixed count keeps CPU reductions in one order.
    torch.set_num_threads(2)
    yield
