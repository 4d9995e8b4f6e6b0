"""``reference`` (the float32 logits Tandem's NumPy model is tested against) and ``sample``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3NextForCausalLM

from scripts.train.checkpoint import load_model

REF_LEN = 48
REF_POSITIONS = (0, 9, 19, 29, 39, 46)  # the MTP at t needs token t+1, so t <= REF_LEN - 2


def reference(model_dir: Path, data: Path, out: Path) -> None:
    """transformers float32 logits (full rows at REF_POSITIONS) + MTP logits, CPU."""
    torch.manual_seed(0)
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lm.eval()
    model = load_model(model_dir)
    model.eval()
    code = np.load(data / "heldout_code.npy")
    prose = np.load(data / "heldout_prose.npy")
    seqs = np.stack([code[1000 : 1000 + REF_LEN], prose[500 : 500 + REF_LEN]]).astype(np.int64)
    ids = torch.from_numpy(seqs)
    pos = np.asarray(REF_POSITIONS, dtype=np.int64)
    with torch.no_grad():
        hf = lm(input_ids=ids).logits.float()
        h = model.hidden(ids)
        own = model.logits(h)
        mtp = model.logits(model.mtp_hidden(h[:, :-1], ids[:, 1:]))
    diff = float((hf - own).abs().max())
    print("transformers vs training-module logits max abs diff", diff)
    np.savez_compressed(
        out,
        input_ids=seqs.astype(np.int32),
        positions=pos.astype(np.int32),
        logits=hf[:, pos].numpy().astype(np.float32),
        mtp_logits=mtp[:, pos].numpy().astype(np.float32),
        top32_idx=hf.topk(32, -1).indices.numpy().astype(np.int32),
        top32_val=hf.topk(32, -1).values.numpy().astype(np.float32),
        mtp_top32_idx=mtp.topk(32, -1).indices.numpy().astype(np.int32),
        mtp_top32_val=mtp.topk(32, -1).values.numpy().astype(np.float32),
        hidden_final=h[:, pos].numpy().astype(np.float32),
    )
    print("wrote", out, out.stat().st_size, "bytes")


def sample(model_dir: Path, prompt: str, max_new: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    text = (f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n")
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
    gen = json.loads((model_dir / "generation_config.json").read_text())
    out = lm.generate(ids, max_new_tokens=max_new, do_sample=False,
                      eos_token_id=gen["eos_token_id"], pad_token_id=gen["pad_token_id"])
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)

