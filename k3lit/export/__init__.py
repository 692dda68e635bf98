"""Export of k3lit checkpoints to other formats (a Hugging Face ``transformers`` folder)."""

from k3lit.export.hf import export_hf

__all__ = ["export_hf"]
