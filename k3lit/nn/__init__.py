"""Layers (``nn.Module``); import submodules directly, e.g. ``from k3lit.nn.moe import MoE``."""

from k3lit.nn.mlp import SwiGLU
from k3lit.nn.moe import MoE, update_balancers

__all__ = ["SwiGLU", "MoE", "update_balancers"]
