"""Evaluate the tiny GSM-style checkpoint: exact-answer accuracy on held-out problems (greedy)
and greedy MTP speculative decoding's accept length, plus a greedy-equality and speed check.

    python scripts/eval_tiny.py --ckpt checkpoints/tiny-gsm --n 500 --k 3

Accuracy is read from the speculative decoder's greedy output, which equals plain greedy
decoding token for token (tests/test_spec_greedy.py); the first --check problems are also
decoded without speculation, to confirm that equality here and to time both.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from impl.data.arith import END, answer_length, extract_answer, take, text_of
from impl.generate import generate
from impl.model import build_model
from impl.speculative import SpecStats, SpeculativeDecoder

MAX_NEW_TOKENS = 160


def finished(new: torch.Tensor) -> bool:
    """The answer is complete once the `#### N` line has ended."""
    return answer_length(text_of(new)) is not None


def answer_text(new: torch.Tensor) -> str:
    text = text_of(new)
    n = answer_length(text)
    return text if n is None else text[:n - len(END)]


@torch.inference_mode()
def step_costs(model, k: int, context: int = 96, reps: int = 100) -> dict[str, float]:
    """Milliseconds per call at a filled cache: a decode step (1 token), a verify step (k+1
    tokens), a chained draft step (the MTP layer at 1 position) and a draft span (k+1 positions,
    the first draft step after a verify). Speculation pays when
    (span + (k-1) draft + verify) / accept length < decode."""
    model.setup_caches(1, model.config.max_seq_len)
    ids = torch.randint(0, model.config.vocab_size, (1, context + k + 1), generator=torch.Generator().manual_seed(0))
    _, hidden = model.forward_with_hidden(ids[:, :context], torch.arange(context))
    mtp = model.mtp[0]

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    def draft(t: int):
        pos = torch.arange(context - t, context)
        cos, sin, mask = model.positions(t, pos)
        return mtp.logits(mtp.hidden(hidden[:, -t:], ids[:, context - t + 1:context + 1], cos, sin, pos, mask))

    return {
        "decode": timed(lambda: model(ids[:, context:context + 1], torch.tensor([context]))),
        "verify": timed(lambda: model.forward_with_hidden(ids[:, context:context + k + 1],
                                                          torch.arange(context, context + k + 1))),
        "draft_step": timed(lambda: draft(1)),
        "draft_span": timed(lambda: draft(k + 1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="checkpoints/tiny-gsm")
    ap.add_argument("--n", type=int, default=500, help="held-out problems")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--check", type=int, default=50, help="problems also decoded without speculation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.ckpt)
    decoder = SpeculativeDecoder(model, args.k)
    stats = SpecStats(args.k)
    correct, mismatches = 0, 0
    spec_s = plain_s = 0.0
    spec_tokens = plain_tokens = 0
    start = time.perf_counter()
    for i, problem in enumerate(take("heldout", args.n)):
        prompt = torch.tensor(list(problem.prompt.encode("ascii")))
        res = decoder.generate(prompt, MAX_NEW_TOKENS, stop=finished)
        stats.merge(res.stats)
        correct += extract_answer(answer_text(res.new_tokens[0])) == problem.result
        if i < args.check:
            plain = generate(model, prompt, res.new_tokens.shape[1])
            mismatches += not torch.equal(plain.tokens, res.tokens)
            spec_s += res.seconds
            spec_tokens += res.new_tokens.shape[1]
            plain_s += plain.prefill_s + plain.decode_s
            plain_tokens += plain.new_tokens.shape[1]
    report = {
        "checkpoint": args.ckpt, "problems": args.n, "exact": correct / args.n, "k": args.k,
        "mean_accept_length": stats.mean_accept_length, "verify_steps": stats.steps,
        "per_position": stats.per_position, "per_position_conditional": stats.per_position_conditional,
        "draft_head_backends": sorted(stats.draft_head_backends),
        "verify_head_backends": sorted(stats.verify_head_backends),
        "greedy_equality": f"{args.check - mismatches}/{args.check}",
        "cpu_tokens_per_s": {"spec": spec_tokens / spec_s if spec_s else None,
                             "plain": plain_tokens / plain_s if plain_s else None},
        "cpu_step_ms": step_costs(model, args.k),
        "wall_s": time.perf_counter() - start, "threads": args.threads,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
