"""Helpers of the tests of our own DiT."""

from __future__ import annotations

import torch


def randomise_zero_inits(dit):
    """Give every zero-initialised tensor random values, so a test exercises every path."""
    with torch.no_grad():
        for p in dit.parameters():
            if not p.any():
                p.normal_(0, 0.05)
