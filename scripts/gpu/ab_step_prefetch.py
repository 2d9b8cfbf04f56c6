#!/usr/bin/env python3
"""Row 3's whole decode step of ling-3.0-flash under side-stream L2 prefetch variants
(impl/model/l2_prefetch.py), timed interleaved in one process.

Variants `NAME=TARGETS[,programs=P][,lines=L][,warps=W][,evict_last=0|1]` separated by `;`,
TARGETS a `+`-joined subset of mla, kda (`off`: no prefetch). Each variant's step must give the
same logits as the first's, bit for bit (the prefetch writes nothing).

    PYTHONPATH=. python3 scripts/gpu/ab_step_prefetch.py --contexts 1024,32768 --variants "off=off;both=mla+kda"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ling_flash import build_row3, cuda_device  # noqa: E402
from impl.gpu_timing import interleaved_replay_us  # noqa: E402
from impl.graphs import capture_graph  # noqa: E402
from impl.model import l2_prefetch  # noqa: E402
from impl.model.kda import KDAAttention  # noqa: E402

CACHE_SLACK = 16


def parse_variants(text: str) -> dict[str, tuple[set[str], l2_prefetch.PrefetchLaunch]]:
    out = {}
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, _, spec = item.partition("=")
        targets, *opts = spec.split(",")
        kw = {}
        for o in opts:
            k, _, v = o.partition("=")
            kw[{"warps": "num_warps"}.get(k, k)] = bool(int(v)) if k in ("evict_last", "late_join") else int(v)
        out[name] = (set() if targets == "off" else set(targets.split("+")), l2_prefetch.PrefetchLaunch(**kw))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--variants", default="off=off;both=mla+kda")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    dev = cuda_device()
    if dev is None:
        return 2
    variants = parse_variants(args.variants)
    model = build_row3(dev)
    token = torch.ones(1, 1, dtype=torch.long, device=dev)
    kda_layers = [m for m in model.modules() if isinstance(m, KDAAttention)]
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        model.setup_caches(1, min(model.config.max_seq_len, ctx + CACHE_SLACK))
        pos = torch.tensor([ctx], device=dev)
        graphs, outs = {}, {}
        with torch.inference_mode():
            for name, (targets, launch) in variants.items():
                l2_prefetch.TARGETS = targets
                l2_prefetch.LAUNCH = launch
                holder = {}
                graphs[name] = capture_graph([lambda: holder.__setitem__("y", model(token, pos)),
                                              l2_prefetch.join_pending])
                for m in kda_layers:
                    m.reset_state()
                graphs[name].replay()
                torch.cuda.synchronize()
                outs[name] = holder["y"].clone()
        first = next(iter(outs))
        for name, y in outs.items():
            print(f"context {ctx} {name}: logits equal to {first}'s: {torch.equal(y, outs[first])}", flush=True)
        samples = interleaved_replay_us(graphs, rounds=args.rounds)
        base = samples[first]
        for name, s in samples.items():
            ratios = [a / b for a, b in zip(s, base)]
            rows.append((ctx, name, statistics.median(s), statistics.median(ratios), min(ratios), max(ratios)))
            print(f"context {ctx} {name}: {statistics.median(s):.1f} us, x{statistics.median(ratios):.4f}", flush=True)
    print("\n| context | variant | step us (median) | / first (median of rounds) | min | max |")
    print("|---|---|---|---|---|---|")
    for ctx, name, us, r, lo, hi in rows:
        print(f"| {ctx} | {name} | {us:.1f} | {r:.4f} | {lo:.4f} | {hi:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
