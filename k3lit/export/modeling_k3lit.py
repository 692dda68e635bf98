"""Hugging Face ``transformers`` classes for a model trained by k3lit (written beside the weights by
``k3lit export``). The network is k3lit's own :class:`~k3lit.model.K3LM` on its pure-torch path (no Triton):
k3lit must be installed where the folder is loaded."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from k3lit.model import K3LM, ModelConfig


class K3LitConfig(PretrainedConfig):
    """``k3lit``: the :class:`~k3lit.model.ModelConfig` fields as a dict (``kda_backend`` forced to ``torch``)."""

    model_type = "k3lit"

    def __init__(self, k3lit: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.k3lit = dict(k3lit or {}, kda_backend="torch")
        kwargs.setdefault("tie_word_embeddings", self.k3lit.get("tie_embeddings", True))
        kwargs.setdefault("vocab_size", self.k3lit.get("vocab_size"))
        super().__init__(**kwargs)


class K3LitForCausalLM(PreTrainedModel, GenerationMixin):
    """``forward(input_ids [B, T]) -> logits [B, T, vocab]`` (and the mean next-token loss given ``labels``).
    ``attention_mask`` (what a tokenizer returns beside the ids) is accepted when it masks nothing: every token of
    a row enters KDA's state and the attention, so a padded batch raises ValueError instead of scoring the padding.

    Generation runs the whole sequence again at every step (no key/value cache is handed to ``generate``);
    ``self.model.generate`` decodes with k3lit's recurrent states instead.
    """

    config_class = K3LitConfig
    base_model_prefix = "model"
    _no_split_modules = ["Sublayer"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # used when tie_word_embeddings

    def __init__(self, config: K3LitConfig) -> None:
        super().__init__(config)
        self.model = K3LM(ModelConfig(**config.k3lit))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The weights come from the checkpoint; k3lit's constructor initialised them already."""

    def get_input_embeddings(self) -> torch.nn.Module:  # noqa: D102
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:  # noqa: D102
        return self.model.lm_head

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:  # noqa: D102
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, **kwargs: Any
    ) -> CausalLMOutput:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("K3LitForCausalLM reads every token of a row: a padded batch (zeros in attention_mask) "
                             "would run the padding through KDA's state and the attention; pass the prompts one "
                             "at a time, or a batch of equal lengths without padding")
        logits = self.model(input_ids)[0]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
