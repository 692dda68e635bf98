"""`k3lit export` writes a Hugging Face folder whose AutoModelForCausalLM gives k3lit's logits and greedy tokens."""

from pathlib import Path

import pytest
import torch
import transformers

from k3lit.cli import main
from k3lit.train.checkpoint import load_model_checkpoint
from k3lit.train.module import K3LitModule

SMALL = [
    "--model.dim=64", "--model.n_layers=2", "--model.layer_pattern=KA", "--model.n_heads=2", "--model.head_dim=32",
    "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64",
    "--model.attnres_block_size=2", "--data.tokenizer=byte", "--data.seq_len=32", "--data.batch_size=4",
    "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--optim.warmup_steps=2",
]


def test_export_loads_in_transformers_with_equal_logits_and_greedy_tokens(tmp_path, stdlib_cache, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(Path(__file__).parents[2])
    main(["fit", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={stdlib_cache}",
          f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.max_steps=4", "--trainer.val_check_interval=4"])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    out = tmp_path / "hf"
    main(["export", "--ckpt", str(ckpt), "--out", str(out)])
    assert {"config.json", "model.safetensors", "modeling_k3lit.py", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}

    whole = load_model_checkpoint(ckpt)
    module = K3LitModule(**{k: v for k, v in whole["hyper_parameters"].items() if not k.startswith("_")})
    module.load_state_dict(whole["state_dict"])
    ref = module.model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # config.json names k3lit
    enc = tok("def main():\n    return", return_tensors="pt")
    ids = enc["input_ids"]
    assert ids[0].tolist() == list(b"def main():\n    return")  # the byte tokenizer's ids
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids)[0], rtol=0, atol=0)
        got = hf.generate(ids, max_new_tokens=12, do_sample=False)
        assert hf.generate(**enc, max_new_tokens=12, do_sample=False).tolist() == got.tolist()  # with its mask
        padded = enc["attention_mask"].clone()
        padded[0, 0] = 0  # as a left-padded row of a batch
        with pytest.raises(ValueError, match="a padded batch .* would run the padding through KDA's state"):
            hf(ids, attention_mask=padded)
    want = ref.generate(ids, 12, temperature=0)
    assert got.tolist() == want.tolist()
    assert tok.decode(got[0]).startswith("def main():\n    return")
