#!/usr/bin/env python3
"""Row 3's whole decode step of ling-3.0-flash with o_proj's weight asked for in L2 by the
kernels before it (KDA's decode kernel, MLA's query kernel), timed interleaved in one process.

Variants `NAME=kda:MODE,mla:MODE` separated by `;` (kda modes 0 none, 1 after its wait, 2 at its
end; mla 0 or 1). Each variant's step must give the same logits as the first's, bit for bit (a
prefetch writes nothing).

    PYTHONPATH=. python3 scripts/gpu/ab_step_prefetch.py --contexts 1024,32768 --variants "off=kda:0,mla:0;both=kda:2,mla:1"
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
from impl.model import kda_decode, mla_absorb  # noqa: E402
from impl.model.kda import KDAAttention  # noqa: E402

CACHE_SLACK = 16


def parse_variants(text: str) -> dict[str, dict[str, int]]:
    out = {}
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, _, spec = item.partition("=")
        out[name] = {k: int(v) for k, _, v in (o.partition(":") for o in spec.split(","))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--variants", default="off=kda:0,mla:0;both=kda:2,mla:1")
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
            for name, modes in variants.items():
                kda_decode.PREFETCH_MODE = modes.get("kda", 0)
                mla_absorb.PREFETCH_MODE = modes.get("mla", 0)
                holder = {}
                graphs[name] = capture_graph([lambda: holder.__setitem__("y", model(token, pos))])
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
