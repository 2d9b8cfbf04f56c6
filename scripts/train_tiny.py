"""Train the `tiny` MoE preset with its MTP layer on generated GSM8K-style arithmetic problems,
on CPU within a wall-clock budget, and write a glm4_moe checkpoint (config.json + safetensors).

    python scripts/train_tiny.py --minutes 29.5 --chain-minutes 2.5 --out checkpoints/tiny-gsm

Recipe (see ../shared/DESIGN.md section 6): byte-level tokens; rows of 320 bytes packed from
consecutive problems; loss = CE of the next token + 0.3 x CE of the MTP layer's token after
next, both only on answer bytes; AdamW with warm-up, a constant rate, then a linear decay over
the last quarter (`--schedule wsd`), timed to the budget (the schedule follows the clock, not a
step count, so a slower machine still ends annealed); routing balanced by nudging the routers'
correction bias (DeepSeek-V3's auxiliary-loss-free balancing) instead of an auxiliary loss.
With `--chain-minutes C`, the last C minutes of the budget train only the MTP layer, on its own
chained outputs at depths 1..k (the target frozen): drafting k tokens feeds the layer its own
output k-1 times, which one-step-ahead training never shows it. The committed checkpoint (29.5
min, 2.5 of them chained) reaches 90.8% exact answers and a greedy k=3 accept length of 3.88
on 500 held-out problems (checkpoints/tiny-gsm/README.md, notes/mtp.md).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from impl.data.arith import problems
from impl.model import MoECausalLM, build_model, get_config
from impl.model.layers import Router
from impl.model.saving import save_checkpoint

MTP_WEIGHT = 0.3
BIAS_STEP = 1e-3  # correction-bias update per step, towards equal expert load


def lr_factor(progress: float, schedule: str, decay_frac: float) -> float:
    """Learning-rate multiplier at `progress` (0..1) of the clock budget. "wsd": constant, then a
    linear decay to 0 over the last `decay_frac`; "cosine": a cosine decay over the whole budget.
    This model is under-trained at the end of a 30-minute CPU budget, so how long the rate stays
    high matters: at the same step (2,000) a cosine compressed into 25 minutes left the loss at
    0.168 where one spread over 29 minutes was at 0.127 (notes/mtp.md)."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return min(1.0, (1.0 - progress) / decay_frac)


def batches(batch: int, row_len: int, seed: int):
    """(ids [B, L+1], answer mask [B, L+1]) from consecutive training problems, packed."""
    stream = problems("train", seed)
    buf_ids: list[int] = []
    buf_mask: list[bool] = []
    need = batch * (row_len + 1)
    while True:
        while len(buf_ids) < need:
            p = next(stream)
            prompt, rest = p.prompt, p.text[len(p.prompt):]
            buf_ids += list(p.text.encode("ascii"))
            buf_mask += [False] * len(prompt) + [True] * len(rest)
        ids = torch.tensor(buf_ids[:need]).view(batch, row_len + 1)
        mask = torch.tensor(buf_mask[:need]).view(batch, row_len + 1)
        del buf_ids[:need], buf_mask[:need]
        yield ids, mask


def _answer_ce(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    return (ce * mask.flatten()).sum() / mask.sum()


def mtp_losses(model: MoECausalLM, last: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
               depths: int) -> list[torch.Tensor]:
    """CE of the MTP layer chained on its own outputs, as speculative drafting runs it: depth d
    reads depth d-1's output hidden state at position i (depth 1: the target's, `last`) and the
    true token i+d, and predicts token i+d+1."""
    mtp, inputs = model.mtp[0], ids[:, :-1]
    h, out = last, []
    for d in range(1, depths + 1):
        t = inputs.shape[1] - d
        cos, sin, _ = model.positions(t, None)
        h = mtp.hidden(h[:, :t], inputs[:, d:d + t], cos, sin, None, None)
        out.append(_answer_ce(mtp.logits(h), ids[:, d + 1:d + 1 + t], mask[:, d + 1:d + 1 + t]))
    return out


def losses(model: MoECausalLM, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token CE of the target, CE of the MTP layer one step ahead), on answer bytes."""
    last = model.last_hidden_states(ids[:, :-1])
    main = _answer_ce(model.lm_head(model.norm(last)), ids[:, 1:], mask[:, 1:])
    return main, mtp_losses(model, last, ids, mask, 1)[0]


def train_chained_mtp(model: MoECausalLM, args, budget_s: float) -> int:
    """Second phase: only the MTP layer learns, on its chained outputs (depths 1..args.chain_depth),
    the target frozen (its hidden states computed without gradients). One step ahead is all the
    first phase teaches; drafting k tokens feeds the layer its own output k-1 times."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp[0].parameters())  # embedding and head are the target's: not in here
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.chain_lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, step, ema = time.monotonic(), 0, None
    for ids, mask in batches(args.batch, args.row_len, args.seed + 1):
        elapsed = time.monotonic() - start
        if elapsed >= budget_s:
            break
        lr = args.chain_lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.no_grad():
            last = model.last_hidden_states(ids[:, :-1])
        per_depth = mtp_losses(model, last, ids, mask, args.chain_depth)
        opt.zero_grad(set_to_none=True)
        sum(per_depth).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        values = [v.item() for v in per_depth]
        ema = values if ema is None else [0.95 * a + 0.05 * b for a, b in zip(ema, values)]
        if step % 20 == 0:
            print(f"chain step {step} t={elapsed / 60:.1f}min mtp by depth {[round(v, 4) for v in ema]}", flush=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=28.0, help="wall-clock training budget")
    ap.add_argument("--out", default="checkpoints/tiny-gsm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--row-len", type=int, default=320)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60, help="warm-up steps")
    ap.add_argument("--schedule", choices=("wsd", "cosine"), default="wsd",
                    help="learning-rate schedule over the clock budget (see lr_factor)")
    ap.add_argument("--decay-frac", type=float, default=0.25, help="wsd: the final fraction that decays to 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=float, default=5.0, help="minutes between interim checkpoints")
    ap.add_argument("--chain-minutes", type=float, default=0.0,
                    help="the last minutes of the budget train only the MTP layer on its chained outputs")
    ap.add_argument("--chain-depth", type=int, default=3, help="chained MTP depths (the k drafted)")
    ap.add_argument("--chain-lr", type=float, default=1e-3)
    ap.add_argument("--init", help="start from this checkpoint folder instead of random weights "
                                   "(e.g. with --chain-minutes equal to --minutes: the chained phase alone)")
    args = ap.parse_args()
    if args.minutes <= 0:
        raise SystemExit("--minutes must be positive")
    if not 0 < args.decay_frac <= 1:
        raise SystemExit("--decay-frac must be in (0, 1]")
    if not 0 <= args.chain_minutes <= args.minutes or args.chain_depth < 1:
        raise SystemExit("--chain-minutes must be in [0, --minutes] and --chain-depth >= 1")
    if args.chain_minutes == args.minutes and not args.init:
        raise SystemExit("--chain-minutes equal to --minutes leaves no time to train the target: give --init")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = get_config("tiny")
    if args.row_len + 1 > config.max_seq_len:
        raise SystemExit(f"--row-len {args.row_len} exceeds the preset's max_seq_len {config.max_seq_len}")
    # The reference MoE backend loops over experts: differentiable, and no [T, k, 2I, H] gather.
    if args.init:
        model = build_model(args.init, moe_backend="reference")
    else:
        model = MoECausalLM(config, moe_backend="reference").init_weights(torch.Generator().manual_seed(args.seed))
    model.train()
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)

    routers = [m for m in model.modules() if isinstance(m, Router)]
    loads: dict[Router, torch.Tensor] = {}
    for r in routers:
        r.register_forward_hook(lambda mod, _inp, out: loads.__setitem__(
            mod, torch.bincount(out[1].flatten(), minlength=config.num_experts)))

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    budget = (args.minutes - args.chain_minutes) * 60
    start = last_save = time.monotonic()
    step, ema = 0, (float("nan"), float("nan"))
    for ids, mask in batches(args.batch, args.row_len, args.seed):
        elapsed = time.monotonic() - start
        if elapsed >= budget:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * lr_factor(elapsed / budget, args.schedule,
                                                                       args.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        main_loss, mtp_loss = losses(model, ids, mask)
        loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for r, load in loads.items():
                r.e_score_correction_bias += BIAS_STEP * torch.sign(load.float().mean() - load.float())
        step += 1
        pair = (main_loss.item(), mtp_loss.item())
        ema = pair if step == 1 else tuple(0.95 * a + 0.05 * b for a, b in zip(ema, pair))
        if step % 20 == 0:
            print(f"step {step} t={elapsed / 60:.1f}min lr={lr:.2e} loss={ema[0]:.4f} mtp={ema[1]:.4f}", flush=True)
        if time.monotonic() - last_save > args.save_every * 60:
            save_checkpoint(model, args.out, metadata=dict(steps=step, minutes=f"{elapsed / 60:.1f}"))
            last_save = time.monotonic()
    chain_steps = train_chained_mtp(model, args, args.chain_minutes * 60) if args.chain_minutes else 0
    elapsed = time.monotonic() - start
    path = save_checkpoint(model, args.out, metadata=dict(steps=step, chain_steps=chain_steps,
                                                          minutes=f"{elapsed / 60:.1f}",
                                                          loss=f"{ema[0]:.4f}", mtp_loss=f"{ema[1]:.4f}"))
    print(f"done: {step} steps in {elapsed / 60:.1f} min, loss {ema[0]:.4f}, mtp {ema[1]:.4f}; "
          f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main()
