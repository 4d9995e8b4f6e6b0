"""Compile figures measured with transformers: ``compile-rate`` (one function at a time, CPU)
and ``validate`` (batched greedy decoding on the validation functions), by the rule of
``scripts/compile_rule.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3NextForCausalLM

from scripts.compile_rule import body_ended, compiles, extract_body, greedy_stop, tally
from scripts.train.checkpoint import load_model
from scripts.train.model import TinyModel
from scripts.train.unlikelihood import first_repeated_line

DEFAULT_TOKENIZER = "models/tandem-tiny/tokenizer.json"


def select_functions(path: Path, n: int) -> list[dict]:
    """n held-out functions, round-robin over top-level packages (deterministic)."""
    groups: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        f = json.loads(line)
        groups.setdefault(f["module"].split(".")[0], []).append(f)
    for g in groups.values():
        g.sort(key=lambda f: (f["module"], f["name"], f["prompt"]))
    out: list[dict] = []
    while len(out) < n and any(groups.values()):
        for key in sorted(groups):
            if groups[key] and len(out) < n:
                out.append(groups[key].pop(0))
    return out


def validation_functions(path: Path, exclude: Path) -> list[dict]:
    """Held-out functions minus the headline ones (matched by module and name): the set that
    chooses checkpoints, so that the headline figure is measured once, unselected."""
    skip = {(f["module"], f["name"]) for f in map(json.loads, exclude.read_text().splitlines())}
    funcs = [json.loads(line) for line in path.read_text().splitlines()]
    return [f for f in funcs if (f["module"], f["name"]) not in skip]


def compile_rate(model_dir: Path, funcs: list[dict], max_new: int) -> dict:
    """Greedy body completions (transformers, float32, CPU) and the share that compiles.

    Decoding runs until the body has ended: a non-blank column-0 line, EOS or ``max_new``
    tokens; the rule of ``scripts/compile_rule.py``, as ``scripts/eval_tiny_model.py``
    (Tandem's NumPy engine) applies it.
    """
    from tokenizers import Tokenizer
    from transformers import StoppingCriteria, StoppingCriteriaList

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]

    class EndOfBody(StoppingCriteria):
        def __init__(self, start: int) -> None:
            self.start = start

        def __call__(self, ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> bool:
            return body_ended(tok.decode(ids[0, self.start:].tolist(), skip_special_tokens=True))

    results = []
    for f in funcs:
        ids = torch.tensor([tok.encode(f["prompt"], add_special_tokens=False).ids])
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=max_new, do_sample=False,
                              eos_token_id=eos, pad_token_id=gen["pad_token_id"],
                              stopping_criteria=StoppingCriteriaList([EndOfBody(ids.shape[1])]))
        new = out[0, ids.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        if new and new[-1] in eos:
            stop = "eos"
        elif body_ended(text):
            stop = "dedent"
        else:
            stop = "limit"
        body = extract_body(text, stop)
        results.append({"module": f["module"], "name": f["name"],
                        "compiles": compiles(f["prompt"], body), "stop": stop,
                        "cut": stop == "limit", "tokens": len(new), "body": body})
    return {**tally(results), "max_new_tokens": max_new, "results": results}


@torch.no_grad()
def greedy_generate(lm: Qwen3NextForCausalLM, prompts: list[list[int]], max_new: int,
                    eos_ids: tuple[int, ...], pad: int, bsz: int) -> list[list[int]]:
    """Batched greedy continuations (left-padded prompts, KV/recurrent cache): ``max_new``
    tokens per prompt, or fewer where EOS came first (EOS kept)."""
    dev = next(lm.parameters()).device
    outs: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for s in range(0, len(order), bsz):
        rows = order[s : s + bsz]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        gen = lm.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos_ids),
                          pad_token_id=pad)[:, width:].tolist()
        for r, i in enumerate(rows):
            g = gen[r]
            e = next((j for j, t in enumerate(g) if t in eos_ids), None)
            outs[i] = g if e is None else g[: e + 1]
    return outs


def shipped_copy(model: TinyModel) -> TinyModel:
    """The weights as shipped: bf16-rounded, run in float32 (a fresh copy, without hooks)."""
    twin = TinyModel(model.config)
    twin.load_state_dict({k: v.to(torch.bfloat16).float()
                          for k, v in model.state_dict().items()})
    twin.set_experts_impl(getattr(model.config, "_experts_implementation", None) or "eager")
    return twin.to(next(model.parameters()).device).eval()


def validate_compile(model: TinyModel, tok: object, funcs: list[dict], max_new: int,
                     eos_ids: tuple[int, ...], pad: int, bsz: int) -> dict:
    """Strict compile figures (the rule of ``scripts/compile_rule.py``) of the shipped weights on
    ``funcs``, greedy, batched on the model's device."""
    twin = shipped_copy(model)
    prompts = [tok.encode(f["prompt"], add_special_tokens=False).ids for f in funcs]
    gens = greedy_generate(twin.lm, prompts, max_new, eos_ids, pad, bsz)
    res = {"functions": len(funcs), "strict": 0, "compiles": 0, "cut": 0, "eos": 0,
           "dedent": 0, "repeat_cut": 0, "body_lines": 0, "ended_lines": 0}
    strict_bodies: dict[str, int] = {}
    for f, g in zip(funcs, gens, strict=True):
        out, stop = greedy_stop(tok, g, max_new, eos_ids)
        text = tok.decode(out, skip_special_tokens=True)
        body = extract_body(text, stop)
        if stop == "limit":
            res["repeat_cut"] += first_repeated_line(body) is not None
        ok = compiles(f["prompt"], body)
        res["compiles"] += ok
        res["strict"] += ok and stop != "limit"
        if ok and stop != "limit":
            strict_bodies[body.strip()] = strict_bodies.get(body.strip(), 0) + 1
        res["cut" if stop == "limit" else stop] += 1
        lines = len([x for x in body.split("\n") if x.strip()])
        res["body_lines"] += lines
        res["ended_lines"] += lines if stop != "limit" else 0
    res["mean_body_lines"] = res.pop("body_lines") / max(len(funcs), 1)
    # non-blank lines per body that ended by itself: a collapse to one-line bodies shows here
    res["mean_ended_lines"] = res.pop("ended_lines") / max(len(funcs) - res["cut"], 1)
    # ... and a collapse to one body for every prompt here: distinct strict bodies, and how
    # often the commonest one came
    res["strict_distinct"] = len(strict_bodies)
    res["strict_commonest"] = max(strict_bodies.values(), default=0)
    return res


def validate(model_dir: Path, functions: Path, exclude: Path, stride: int, max_new: int,
             bsz: int) -> dict[str, Any]:
    """The ``validate`` sub-command: every ``stride``-th validation function."""
    from tokenizers import Tokenizer

    model = load_model(model_dir)
    tok_file = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file) if tok_file.exists() else DEFAULT_TOKENIZER)
    val = validation_functions(functions, exclude)[::stride]
    cfg = model.config
    return validate_compile(model, tok, val, max_new, (cfg.eos_token_id, cfg.bos_token_id),
                            cfg.bos_token_id, bsz)
