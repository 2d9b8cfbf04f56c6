#!/usr/bin/env python3
"""Row 3's whole decode step of ling-3.0-flash (one CUDA graph) under variants of its GEMV tiles
and its KDA/MLA layers' backends, timed interleaved in one process: which choice is fastest where
it counts, in the step.

Why: scripts/gpu/bench_gemv.py times each projection after a norm kernel, a producer of 2-3 us,
so its sweep favours tiles that load little before the PDL wait. In the step each o_proj follows
a longer kernel (KDA's decode, MLA's output kernel), during which a program could hold more of
its weight rows (a tile as long as the row: all of them) before waiting for x. And a change to a
step's chain of launches (a layer backend: `attention:torch`, `projection:cublas`) shows its worth
only against the same step without it.

Variants: `NAME=ITEM[+ITEM...]` separated by `;`, each ITEM either a tile `N,K:BLOCK_N,BLOCK_K,WARPS`
overriding impl.model.gemv's TUNED for that weight shape, or a layer backend `KIND:BACKEND`
(impl.model.layer_backends) for every KDA and MLA layer. The first variant is the base every
ratio is taken against; a bare NAME changes nothing. Each overridden tile is checked against an
fp32 product (relative error <= 1e-2) before timing.

    PYTHONPATH=. python3 scripts/gpu/ab_step.py --contexts 1024 --variants "committed;o=2560,4096:2,4096,4"
    PYTHONPATH=. python3 scripts/gpu/ab_step.py --contexts 1024,8192 --variants "gemv;cublas=projection:cublas"
Prints a table last: per variant the step's median replay (us) and its round-by-round ratio to the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ling_flash import build_row3, cuda_device  # noqa: E402
from impl import backends  # noqa: E402
from impl.decode_runner import PlainRunner  # noqa: E402
from impl.gpu_timing import interleaved_replay_us  # noqa: E402
from impl.graphs import capture_graph  # noqa: E402
from impl.model import gemv  # noqa: E402
from impl.model.layer_backends import DEFAULTS, PARTS, set_layer_backend  # noqa: E402

CACHE_SLACK = 16
MAX_REL = 1e-2


@dataclass
class Variant:
    tiles: dict[tuple[int, int], gemv.GemvLaunch] = field(default_factory=dict)  # (N, K) -> launch
    layers: dict[str, str] = field(default_factory=dict)  # layer backend kind -> backend


def _item(part: str, variant: Variant) -> None:
    head, _, tail = part.partition(":")
    if "," not in head:  # KIND:BACKEND
        if head not in PARTS:
            raise ValueError(f"unknown layer backend kind {head!r}; expected one of {list(PARTS)}")
        if tail not in backends.available(head):
            raise ValueError(f"unknown {head} backend {tail!r}; known: {backends.available(head)}")
        variant.layers[head] = tail
        return
    n, k = (int(v) for v in head.split(","))
    bn, bk, w = (int(v) for v in tail.split(","))
    variant.tiles[(n, k)] = gemv.GemvLaunch(block_n=bn, block_k=bk, num_warps=w)


def parse_variants(text: str) -> dict[str, Variant]:
    """name -> Variant from `NAME=ITEM[+...]` items separated by `;` (module docstring); ValueError
    naming the item that does not parse."""
    out = {}
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, _, spec = item.partition("=")
        variant = Variant()
        try:
            for part in filter(None, spec.split("+")):
                _item(part, variant)
        except ValueError as e:
            raise ValueError(f"variant {item!r}: expected NAME=N,K:BLOCK_N,BLOCK_K,WARPS or NAME=KIND:BACKEND "
                             f"[+...] ({e})") from None
        if not name or name in out:
            raise ValueError(f"variant {item!r}: {'no' if not name else 'a repeated'} name")
        out[name] = variant
    if not out:
        raise ValueError("no variants")
    return out


def apply(model, variant: Variant, committed: dict) -> None:
    """The model and the GEMV table as `variant` says: its tiles over the committed table, its
    layer backends over the defaults."""
    gemv.TUNED.clear()
    gemv.TUNED.update({**committed, **variant.tiles})
    for kind, default in DEFAULTS.items():
        set_layer_backend(model, kind, variant.layers.get(kind, default))


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
    for v in variants.values():
        check_tiles(v.tiles, dev)
    model = build_row3(dev)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        step = PlainRunner(model, capacity=min(model.config.max_seq_len, ctx + CACHE_SLACK)).held_step(ctx)
        graphs = {}
        with torch.inference_mode():
            for name, variant in variants.items():
                apply(model, variant, committed)
                with backends.record_provenance() as prov:
                    graphs[name] = capture_graph([step])
                ran = sorted({f"{e.kind}={e.backend}:{e.kernel}" for e in prov.events if e.kind in PARTS})
                print(f"context {ctx} {name}: layer kernels captured: {', '.join(ran)}", flush=True)
        apply(model, Variant(), committed)
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
