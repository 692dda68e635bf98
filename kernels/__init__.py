"""Triton kernels of k3lit, installed as ``k3lit.kernels`` (one folder per operator)."""
