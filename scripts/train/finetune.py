"""The ``finetune-ul`` sub-command: unlikelihood + self-training rounds on the model's own
greedy completions, checkpoints chosen on the validation functions' strict compile count."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from scripts.train.checkpoint import load_model, save_checkpoint
from scripts.train.compile_rate import (
    greedy_generate,
    shipped_copy,
    validate_compile,
    validation_functions,
)
from scripts.train.data import TRAIN_KINDS, Sampler, load_streams, parse_kind_weights
from scripts.train.gdn import fast_chunk_gated_delta_rule_installed
from scripts.train.losses import RouterTap, adamw, evaluate, losses
from scripts.train.model import TinyModel
from scripts.train.unlikelihood import function_prompts, ul_batch, ul_losses


def finetune_ul(args: argparse.Namespace) -> None:
    """Sequence-level unlikelihood fine-tuning on the model's own greedy completions.

    Each round: greedy completions (``--max-new`` tokens) of ``--gen-batch`` train-split
    function prompts; then ``--steps-per-round`` AdamW steps, each on a share of those rows:
    loss = CE + mtp_weight * MTP CE + aux_weight * balance (a regular training batch, so that
    perplexity and the MTP head hold) + ul_weight * -log(1 - p) on completion tokens that
    belong to a repeated n-gram (Welleck et al. 2019) + st_weight * CE on the completion's body
    cut before its first repeated line and ended by EOT, where that body compiles. Every
    ``--val-every`` seconds: the strict compile count on the validation functions (held-out
    minus the headline 100) and held-out code CE; the best checkpoint whose code CE rose by at
    most ``--max-ce-rise`` is saved.
    """
    from tokenizers import Tokenizer

    t_start = time.time()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tok = Tokenizer.from_file(str(args.tokenizer))
    model = load_model(args.init).to(dev)
    state_file = args.init / "train_state.json"
    meta_prev = json.loads(state_file.read_text()) if state_file.exists() else {}
    print("gdn", fast_chunk_gated_delta_rule_installed(), flush=True)
    impl = args.experts_impl or ("grouped_mm" if dev.type == "cuda" else "eager")
    model.set_experts_impl(impl)
    cfg = model.config
    eot, eos_ids = cfg.bos_token_id, (cfg.eos_token_id, cfg.bos_token_id)
    sampler = Sampler(load_streams(args.data, "train", dev, TRAIN_KINDS), args.seq,
                      args.seed * 1_000_003 + int(meta_prev.get("step", 0)),
                      parse_kind_weights(args.kind_weights))
    held = load_streams(args.data, "heldout", dev)
    prompts = function_prompts(tok, np.load(args.data / "train_func.npy"), eot, args.max_prompt)
    val = validation_functions(args.functions, args.exclude)
    if args.val_limit:
        val = val[: args.val_limit]
    print(f"train prompts {len(prompts)}, validation functions {len(val)}", flush=True)
    opt = adamw(model, args.lr, args.weight_decay, dev)
    tap = RouterTap(model)
    autocast = dev.type == "cuda"
    history: list[dict] = []
    best: dict = {}

    def check(step: int) -> None:
        t0 = time.time()
        v = validate_compile(model, tok, val, args.max_new, eos_ids, eot, args.gen_batch)
        ev = evaluate(shipped_copy(model), {"code": held["code"]}, args.seq, args.check_windows,
                      args.batch)["code"]
        tap.logits.clear()
        rec = {"step": step, "t": round(time.time() - t_start, 1), **v,
               "code_ce": round(ev["main"], 4), "mtp_agree": round(ev["agree"], 4),
               "seconds": round(time.time() - t0, 1)}
        history.append({"check": rec})
        print("check", json.dumps(rec), flush=True)
        base_ce = history[0]["check"]["code_ce"]
        if rec["code_ce"] <= base_ce + args.max_ce_rise and (
                not best or (v["strict"], -rec["code_ce"]) > (best["check"]["strict"],
                                                             -best["check"]["code_ce"])):
            best.update(check=rec, state={k: t.detach().to("cpu", copy=True)
                                          for k, t in model.state_dict().items()})

    check(0)
    step, rounds = 0, 0
    next_check = time.time() + args.val_every
    while time.time() - t_start < args.time_budget - args.reserve and (
            not args.max_rounds or rounds < args.max_rounds):
        t0 = time.time()
        pick = rng.choice(len(prompts), size=min(args.gen_batch, len(prompts)), replace=False)
        chosen = [prompts[i] for i in pick]
        model.eval()
        gens = greedy_generate(model.lm, [p["ids"] for p in chosen], args.max_new, eos_ids,
                               eot, args.gen_batch)
        tap.logits.clear()
        model.train()
        t_gen = time.time() - t0
        parts = [ul_batch(tok, chosen[i::args.steps_per_round], gens[i::args.steps_per_round],
                          args.max_new, eos_ids, eot, args.ngram, dev)
                 for i in range(args.steps_per_round)]
        for part in parts:
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                main, mtp, _ = losses(model, sampler.batch(args.batch))
                loss = main + args.mtp_weight * mtp
                ul = st = torch.zeros((), device=dev)
                if "ul" in part and args.ul_weight:
                    ul = ul_losses(model, *part["ul"])[0]
                if "st" in part and args.st_weight:
                    st = ul_losses(model, *part["st"])[1]
                aux = tap.balance_loss()
            loss = loss + args.ul_weight * ul + args.st_weight * st + args.aux_weight * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
        rounds += 1
        stats = {k: sum(p["stats"][k] for p in parts) for k in parts[0]["stats"]}
        rec = {"round": rounds, "step": step, "main": round(float(main), 4),
               "mtp": round(float(mtp), 4), "ul": round(float(ul), 4), "st": round(float(st), 4),
               "gn": round(float(gnorm), 3), "gen_s": round(t_gen, 1),
               "round_s": round(time.time() - t0, 1), **stats}
        history.append(rec)
        print("round", json.dumps(rec), flush=True)
        if time.time() > next_check:
            check(step)
            next_check = time.time() + args.val_every
    if not history[-1].get("check") or history[-1]["check"]["step"] != step:
        check(step)
    shipped = TinyModel(model.config)
    shipped.load_state_dict(best["state"])
    shipped.set_experts_impl(impl)
    meta = dict(meta_prev)
    meta["unlikelihood"] = list(meta_prev.get("unlikelihood", [])) + [{
        "init": str(args.init), "steps": step, "rounds": rounds, "best": best["check"],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "history": history}]
    save_checkpoint(shipped, args.out, meta)
    if args.final_eval:
        final = load_model(args.out).to(dev)
        final.set_experts_impl(impl)
        ev = evaluate(final, held, args.seq, args.eval_windows, args.batch)
        meta["unlikelihood"][-1]["heldout_fp32"] = ev
        print("heldout", json.dumps(ev), flush=True)
        (args.out / "train_state.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"saved {args.out} (best check {json.dumps(best['check'])}) "
          f"total {time.time() - t_start:.0f}s", flush=True)

