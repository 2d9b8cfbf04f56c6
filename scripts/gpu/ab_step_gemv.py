#!/usr/bin/env python3
"""Row 3's whole decode step of ling-3.0-flash (one CUDA graph) under GEMV launch variants, timed
interleaved in one process: which projection tiles are fastest where it counts, in the step.

Why: scripts/gpu/bench_gemv.py times each projection after a norm kernel, a producer of 2-3 us,
so its sweep favours tiles that load little before the PDL wait. In the step each o_proj follows
a longer kernel (KDA's decode, MLA's output kernel), during which a program could hold more of
its weight rows (a tile as long as the row: all of them) before waiting for x.

Variants: `NAME=N,K:BLOCK_N,BLOCK_K,WARPS[+N,K:...]` separated by `;` override impl.model.gemv's
TUNED for those weight shapes; the first variant, `committed`, is the tuned table as it stands.
Each overridden tile is checked against an fp32 product (relative error <= 1e-2) before timing.

    PYTHONPATH=. python3 scripts/gpu/ab_step_gemv.py --contexts 1024 --variants "committed;o=2560,4096:2,4096,4"
Prints a table last: per variant the step's median replay (us) and its round-by-round ratio to committed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ling_flash import build_row3, cuda_device  # noqa: E402
from impl.generate import greedy_step_at  # noqa: E402
from impl.gpu_timing import interleaved_replay_us  # noqa: E402
from impl.graphs import capture_graph  # noqa: E402
from impl.model import gemv  # noqa: E402

CACHE_SLACK = 16
MAX_REL = 1e-2


def parse_variants(text: str) -> dict[str, dict[tuple[int, int], gemv.GemvLaunch]]:
    """name -> {(N, K): launch} from `NAME=N,K:BLOCK_N,BLOCK_K,WARPS[+...]` items separated by `;`
    (a bare NAME overrides nothing); ValueError naming the item that does not parse."""
    out = {}
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, _, spec = item.partition("=")
        tiles = {}
        try:
            for part in filter(None, spec.split("+")):
                shape, _, tile = part.partition(":")
                n, k = (int(v) for v in shape.split(","))
                bn, bk, w = (int(v) for v in tile.split(","))
                tiles[(n, k)] = gemv.GemvLaunch(block_n=bn, block_k=bk, num_warps=w)
        except ValueError as e:
            raise ValueError(f"variant {item!r}: expected NAME=N,K:BLOCK_N,BLOCK_K,WARPS[+...] ({e})") from None
        if not name or name in out:
            raise ValueError(f"variant {item!r}: {'no' if not name else 'a repeated'} name")
        out[name] = tiles
    if not out:
        raise ValueError("no variants")
    return out


def check_tiles(tiles: dict[tuple[int, int], gemv.GemvLaunch], dev) -> None:
    for (n, k), launch in tiles.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        got, want = gemv.gemv(x, w, launch).float(), gemv.gemv_reference(x, w).float()
        rel = ((got - want).norm() / want.norm()).item()
        if rel > MAX_REL:
            raise SystemExit(f"tile {launch} on ({n}, {k}) is wrong: relative error {rel:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--variants", default="committed")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    dev = cuda_device()
    if dev is None:
        return 2
    variants = parse_variants(args.variants)
    committed = dict(gemv.TUNED)
    for tiles in variants.values():
        check_tiles(tiles, dev)
    model = build_row3(dev)
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        model.setup_caches(1, min(model.config.max_seq_len, ctx + CACHE_SLACK))
        pos = torch.tensor([ctx], device=dev)
        graphs = {}
        with torch.inference_mode():
            for name, tiles in variants.items():
                gemv.TUNED.clear()
                gemv.TUNED.update({**committed, **tiles})
                graphs[name] = capture_graph([lambda: greedy_step_at(model, token, pos)])
        gemv.TUNED.clear()
        gemv.TUNED.update(committed)
        samples = interleaved_replay_us(graphs, rounds=args.rounds)
        base = samples[next(iter(variants))]
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
