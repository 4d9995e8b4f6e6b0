"""The ``train`` sub-command: train or resume under a wall-clock budget, save a checkpoint."""

from __future__ import annotations

import argparse
import json
import time

import torch

from scripts.train.checkpoint import load_model, save_checkpoint
from scripts.train.data import TRAIN_KINDS, Sampler, load_streams, parse_kind_weights
from scripts.train.gdn import fast_chunk_gated_delta_rule_installed
from scripts.train.losses import RouterTap, adamw, evaluate, losses
from scripts.train.model import TinyModel, count_params, make_config


def pick_experts_impl(model: TinyModel, sampler: Sampler, bsz: int, dev: torch.device,
                      candidates: list[str]) -> str:
    best, best_t = candidates[0], float("inf")
    for impl in candidates:
        try:
            model.set_experts_impl(impl)
            for i in range(4):
                if i == 1:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    main, mtp, _ = losses(model, sampler.batch(bsz))
                (main + mtp).backward()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 3
            model.zero_grad(set_to_none=True)
            print(f"experts_impl {impl}: {dt * 1000:.1f} ms/step", flush=True)
            if dt < best_t:
                best, best_t = impl, dt
        except Exception as exc:  # noqa: BLE001 - any failure just rules the candidate out
            print(f"experts_impl {impl} failed: {exc!r}", flush=True)
            model.zero_grad(set_to_none=True)
    model.set_experts_impl(best)
    return best


def train(args: argparse.Namespace) -> None:
    t_start = time.time()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta_prev: dict = {}
    if args.resume:
        model = load_model(args.resume)
        meta_prev = json.loads((args.resume / "train_state.json").read_text())
    else:
        dmeta = json.loads((args.data / "meta.json").read_text())
        model = TinyModel(make_config(dmeta["vocab_size"]))
    model.to(dev)
    print("params", count_params(model), "gdn", fast_chunk_gated_delta_rule_installed(),
          flush=True)
    weights = parse_kind_weights(args.kind_weights)
    train_streams = load_streams(args.data, "train", dev, TRAIN_KINDS)
    held_streams = load_streams(args.data, "heldout", dev)
    step0 = int(meta_prev.get("step", 0))
    tokens0 = int(meta_prev.get("tokens_seen", 0))
    sampler = Sampler(train_streams, args.seq, args.seed * 1_000_003 + step0, weights)
    print("train kinds", {k: (int(train_streams[k].numel()), weights[k]) for k in sampler.kinds},
          flush=True)
    autocast = dev.type == "cuda"
    impl = "eager"
    if dev.type == "cuda":
        cands = [args.experts_impl] if args.experts_impl else ["grouped_mm", "eager"]
        impl = pick_experts_impl(model, sampler, args.batch, dev, cands)
    opt = adamw(model, args.lr, args.weight_decay, dev)
    tap = RouterTap(model)
    budget = args.time_budget - (time.time() - t_start)
    t0 = time.time()
    step, tokens = 0, 0
    history: list[dict] = list(meta_prev.get("history", []))
    ema = None
    next_eval = t0 + args.eval_every
    speed_logged = False
    while True:
        elapsed = time.time() - t0
        # progress: the larger of the time and token fractions, so that the decay phase ends
        # with the run whichever limit comes first
        frac = elapsed / budget
        if args.max_tokens:
            frac = max(frac, tokens / args.max_tokens)
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / args.warmup)
        lr_scale = warm
        if args.decay_frac > 0 and frac > 1 - args.decay_frac:
            into = (frac - (1 - args.decay_frac)) / args.decay_frac
            lr_scale *= 1 - (1 - args.min_lr_ratio) * into
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        ids = sampler.batch(args.batch)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            main, mtp, _ = losses(model, ids)
            aux = tap.balance_loss()
        loss = main + args.mtp_weight * mtp + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += ids.shape[0] * args.seq
        if step % args.log_every == 0 or step <= 3:
            vals = (float(main), float(mtp), float(aux), float(gnorm))
            ema = vals if ema is None else tuple(0.9 * a + 0.1 * b for a, b in zip(ema, vals,
                                                                                  strict=True))
            el = time.time() - t0
            print(f"step {step0 + step} tok {tokens0 + tokens} main {vals[0]:.3f} "
                  f"mtp {vals[1]:.3f} aux {vals[2]:.3f} gn {vals[3]:.2f} "
                  f"lr {args.lr * lr_scale:.2e} {tokens / el:.0f} tok/s t {el:.0f}s", flush=True)
            history.append({"step": step0 + step, "tokens": tokens0 + tokens, "main": vals[0],
                            "mtp": vals[1], "aux": vals[2], "t": round(el, 1)})
        if not speed_logged and step == 12:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(f"SPEED after 12 steps: {tokens / (time.time() - t0):.0f} tok/s "
                  f"(experts_impl {impl})", flush=True)
            speed_logged = True
        if time.time() > next_eval:
            ev = evaluate(model, {"code": held_streams["code"]}, args.seq, 32, args.batch,
                          autocast)
            tap.logits.clear()
            print(f"eval step {step0 + step} code ce {ev['code']['main']:.3f} "
                  f"mtp {ev['code']['mtp']:.3f} agree {ev['code']['agree']:.3f}", flush=True)
            next_eval = time.time() + args.eval_every
    train_time = time.time() - t0
    print(f"trained {step} steps, {tokens} tokens in {train_time:.0f}s "
          f"({tokens / max(train_time, 1e-9):.0f} tok/s)", flush=True)
    meta = {
        "step": step0 + step, "tokens_seen": tokens0 + tokens,
        "train_seconds": float(meta_prev.get("train_seconds", 0)) + train_time,
        "runs": list(meta_prev.get("runs", [])) + [{
            "steps": step, "tokens": tokens, "seconds": round(train_time, 1),
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "experts_impl": impl, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "warmup": args.warmup, "decay_frac": args.decay_frac,
            "min_lr_ratio": args.min_lr_ratio, "max_tokens": args.max_tokens,
            "resumed_from_step": step0}],
        "history": history[-400:],
        "recipe": {"mtp_weight": args.mtp_weight, "aux_weight": args.aux_weight,
                   "weight_decay": args.weight_decay, "clip": args.clip,
                   "kind_weights": {k: weights[k] for k in sampler.kinds},
                   "train_tokens": {k: int(train_streams[k].numel()) for k in sampler.kinds},
                   "optimizer": "AdamW(0.9,0.95)"},
    }
    # Evaluate the weights as shipped: bf16-rounded, run in float32.
    save_checkpoint(model, args.out, meta)
    if args.final_eval:
        shipped = load_model(args.out).to(dev)
        shipped.set_experts_impl(impl)
        ev = evaluate(shipped, held_streams, args.seq, args.eval_windows, args.batch, False)
        meta["heldout_fp32"] = ev
        print("heldout", json.dumps(ev), flush=True)
        (args.out / "train_state.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"saved {args.out} total {time.time() - t_start:.0f}s", flush=True)

