"""Kernel tests: every buffer a kernel allocates starts as NaN, so an output it forgets to write fails."""

import pytest
import torch


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """NaN-fill every floating torch.empty / empty_like / new_empty (unwritten outputs then fail)."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: fill(new_empty(self, *a, **kw)))
