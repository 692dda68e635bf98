"""``k3lit export``: a checkpoint as a folder that ``transformers.AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` loads."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from k3lit.data.datamodule import K3DataModule
from k3lit.data.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer
from k3lit.data.tokenizer import Tokenizer as K3Tokenizer
from k3lit.lightning_compat import init_args
from k3lit.train.checkpoint import load_model_checkpoint

MODELING = Path(__file__).with_name("modeling_k3lit.py")


def export_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write ``out``: ``config.json``, ``model.safetensors`` (float32 weights and buffers under ``model.``; a tied
    LM head is stored once, as the embedding), ``modeling_k3lit.py``, ``tokenizer.json`` (Hugging Face
    ``tokenizers``) with ``tokenizer_config.json``, and ``generation_config.json``.

    Args:
        ckpt: a ``.ckpt`` file or a sharded checkpoint folder of ``k3lit fit``; its weights are read once into CPU
            memory, its optimizer states not at all (:func:`~k3lit.train.checkpoint.load_model_checkpoint`).
        out: the folder to write (created; existing files of the same names are replaced).

    Returns:
        ``out`` as a Path.

    Raises:
        FileNotFoundError: ``ckpt`` is neither a checkpoint file nor a sharded checkpoint folder.
    """
    from safetensors.torch import save_file

    from k3lit.data.datamodule import tokenizer_from_state

    whole = load_model_checkpoint(ckpt)
    cfg = whole["hyper_parameters"]["model"]
    weights = {k: v.float().contiguous() for k, v in whole["state_dict"].items() if k.startswith("model.")}
    if cfg.tie_embeddings:
        weights.pop("model.lm_head.weight", None)
    state = whole.get(K3DataModule.__qualname__)  # the tokenizer travels inside the checkpoint
    if state is not None:
        tok = tokenizer_from_state(state)
    else:
        tok = K3DataModule(**init_args(whole["datamodule_hyper_parameters"])).tokenizer
    saved_json = state.get("tokenizer_json") if state is not None else None
    hf_tok = Tokenizer.from_str(saved_json) if saved_json else _tokenizers_file(tok)
    del whole
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    k3 = dict(dataclasses.asdict(cfg), kda_backend="torch")
    config = {
        "architectures": ["K3LitForCausalLM"], "model_type": "k3lit", "k3lit": k3,
        "auto_map": {"AutoConfig": "modeling_k3lit.K3LitConfig",
                     "AutoModelForCausalLM": "modeling_k3lit.K3LitForCausalLM"},
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
        "eos_token_id": tok.eos_id, "bos_token_id": None, "pad_token_id": tok.eos_id,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id, "use_cache": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shutil.copyfile(MODELING, out / MODELING.name)
    eos = hf_tok.id_to_token(tok.eos_id)
    hf_tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
                  "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def _tokenizers_file(tok: K3Tokenizer) -> Tokenizer:
    """``tok`` as a Hugging Face ``tokenizers`` object with the same ids: the file it was loaded from, or for
    the byte tokenizer a byte-level model with no merges whose id of each byte is its value (eos = 256)."""
    if isinstance(tok, HFTokenizer):
        return Tokenizer.from_file(str(tok.path))
    if not isinstance(tok, ByteTokenizer):
        raise TypeError(f"no tokenizers form of {tok!r}")
    vocab = {_byte_char(b): b for b in range(256)} | {EOS_TOKEN: 256}
    t = Tokenizer(models.BPE(vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([EOS_TOKEN])
    return t


def _byte_char(b: int) -> str:
    """The printable character the byte-level pre-tokenizer writes for byte ``b``: printable Latin-1 bytes stand
    for themselves, the others (controls, space, soft hyphen...) take ``chr(256 + n)`` in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))
