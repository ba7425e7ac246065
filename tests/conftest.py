"""Fixtures shared by several test modules (opt in per module with ``pytest.mark.usefixtures``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors run fastest on one intra-op thread: more threads only spin-wait when other processes
    share the cores (5x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
