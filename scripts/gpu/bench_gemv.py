#!/usr/bin/env python3
"""The decode step's bf16 projections (one token) through cuBLAS and through impl.model.gemv's
Triton GEMV, each after the kernel that feeds it, side by side on a CUDA GPU, against their byte
floor.

Why: at Ling-3.0-flash shapes cuBLAS reads KDA's fused input projection at 63% of the copy
bandwidth and o_proj at 32-40% (notes/ling.md); those GEMVs are most of the step's distance from
its floor (notes/ling-ladder.md). In the step every projection follows a short kernel that makes
its input (a norm, the attention kernel); `gemv_kernel` launched with programmatic dependent launch
starts streaming its weight while that kernel still runs. So each contender is timed as a chain:
the producer (`add_rms_norm`, PDL-launched before a PDL GEMV) then the projection, COPIES pairs
cycled inside one captured graph so that every call reads its weight from HBM (o_proj's 21 MB
would otherwise sit in the 50 MB L2); the producer alone is timed the same way and subtracted.

Weights: each projection of one KDA and one MLA layer at Ling-3.0-flash shapes (the fused input
projections as build_model leaves them, and o_proj) and the dense MLP's, random normal * 0.02 in
bf16. Each contender is checked against an fp32 product first (relative error <= 1e-2: bf16 output
rounding is 4e-3) and skipped, saying so, where it is wrong. Timing:
`impl.gpu_timing.interleaved_replay_us` (every chain takes turns, ROUNDS rounds), microseconds
per projection, as a fraction of the weight's bytes at the copy bandwidth measured in the same
process.

    PYTHONPATH=. python3 scripts/gpu/bench_gemv.py --out $OUT      # from the repository root
Prints a table last; writes DIR/gemv_bench.json. Exit status 0; 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import build_kda, build_mla  # noqa: E402
from impl.model.gemv import GemvLaunch  # noqa: E402

COPIES = 6  # weights cycled per replay: 6 x 21 MB > 2 x the H200's 50 MB L2
ROUNDS, REP_MS = 3, 50
# The sweep: rows a program, hidden elements a loop step, warps, launched with PDL; the best tile
# is also run without PDL (is it the early start, or the kernel?). --committed times only the
# tile impl.model.gemv.launch_for picks.
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (256, 512, 1024)
WARPS = (4, 8)
MAX_REL = 1e-2


def projections() -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each bf16 weight a decode token reads outside the MoE layers."""
    kda, mla = build_kda("meta"), build_mla("meta")
    kda.fuse_projections()
    mla.fuse_projections()
    shapes = {"kda in_proj (q|k|v|f|g|b)": tuple(kda.in_proj.shape), "kda o_proj": tuple(kda.o_proj.weight.shape),
              "mla in_proj (q|kv_a|g)": tuple(mla.in_proj.shape), "mla o_proj": tuple(mla.o_proj.weight.shape)}
    shapes.update({"dense gate / up": (6144, 2560), "dense down": (2560, 6144)})
    return shapes


def launches(n: int | None = None, k: int | None = None) -> list[GemvLaunch]:
    """The sweep's tiles; with n and k, the committed one for that shape alone."""
    if n is not None:
        from impl.model.gemv import launch_for
        return [launch_for(n, k)]
    return [GemvLaunch(bn, bk, w) for bn, bk, w in itertools.product(BLOCK_N, BLOCK_K, WARPS)]


def label(launch: GemvLaunch) -> str:
    return f"{launch.block_n}x{launch.block_k} w{launch.num_warps}" + ("" if launch.pdl else " no-pdl")


def chain(producer, project, xs, ws, outs):
    """COPIES (producer, projection) pairs: the producer writes x, the projection reads it."""
    calls = []
    for w, o in zip(ws, outs):
        calls += [producer, lambda w=w, o=o: project(xs[0], w, o)]
    return calls


def bench_shape(name: str, n: int, k: int, bandwidth: float, gen: torch.Generator, committed: bool) -> dict:
    from impl.gpu_timing import interleaved_replay_us
    from impl.graphs import capture_graph
    from impl.model.add_rms_norm import add_rms_norm_triton
    from impl.model.gemv import gemv
    dev = torch.device("cuda")
    ws = [torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen) for _ in range(COPIES)]
    delta, residual = (torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_w = torch.rand(k, device=dev, generator=gen).to(torch.bfloat16) + 0.5
    xs: list[torch.Tensor] = [add_rms_norm_triton(delta, residual, norm_w, 1e-6)[0]]

    def producer(pdl: bool):
        def call():  # the projection after it reads what this launch made
            xs[0] = add_rms_norm_triton(delta, residual, norm_w, 1e-6, pdl=pdl)[0]
        return call

    ref = xs[0].float() @ ws[0].float().t()
    outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    calls = {"producer alone": [producer(False)] * COPIES,
             "producer + PDL alone": [producer(True)] * COPIES,
             "cublas": chain(producer(False), lambda x, w, o: torch.mm(x, w.t(), out=o), xs, ws, outs)}
    rejected, tiles = {}, {}
    for launch in (launches(n, k) if committed else launches()):
        try:
            outs[0].fill_(float("nan"))
            gemv(xs[0], ws[0], launch, out=outs[0])
            rel = float((outs[0].float() - ref).norm() / ref.norm())
            if not rel <= MAX_REL:
                rejected[label(launch)] = f"relative error {rel:.2e}"
                continue
        except Exception as e:  # a config the compiler refuses (registers)
            rejected[label(launch)] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        tiles[label(launch)] = launch
        calls[label(launch)] = chain(producer(True), lambda x, w, o, launch=launch: gemv(x, w, launch, out=o),
                                     xs, ws, outs)
    with torch.inference_mode():
        graphs = {lab: capture_graph(fns) for lab, fns in calls.items()}
        times = interleaved_replay_us(graphs, rounds=ROUNDS, rep=REP_MS)
    pair = {lab: sorted(t)[len(t) // 2] / COPIES for lab, t in times.items()}
    best = min(tiles, key=pair.get, default=None)
    if best is not None:  # the best tile again, launched without PDL
        plain = dataclasses.replace(tiles[best], pdl=False)
        calls = {"cublas": calls["cublas"], best: calls[best], "producer alone": calls["producer alone"],
                 label(plain): chain(producer(False), lambda x, w_, o: gemv(x, w_, plain, out=o), xs, ws, outs)}
        with torch.inference_mode():
            graphs = {lab: capture_graph(fns) for lab, fns in calls.items()}
            again = interleaved_replay_us(graphs, rounds=ROUNDS, rep=REP_MS)
        pair.update({lab: sorted(t)[len(t) // 2] / COPIES for lab, t in again.items()})
    alone = pair["producer alone"]
    us = {lab: t - alone for lab, t in pair.items() if not lab.startswith("producer")}
    floor = n * k * 2 / bandwidth * 1e6
    return {"name": name, "n": n, "k": k, "mbytes": n * k * 2 / 1e6, "floor_us": floor, "pair_us": pair,
            "us": us, "best": best, "rejected": rejected}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gemv_bench.json")
    p.add_argument("--committed", action="store_true", help="time only the tile impl.model.gemv commits per shape")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA device", file=sys.stderr)
        return 2
    from impl.gpu_timing import copy_bandwidth
    from pytest_moeperf.baselines import atomic_write_text
    bandwidth = copy_bandwidth("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [bench_shape(name, n, k, bandwidth, gen, args.committed) for name, (n, k) in projections().items()]
    atomic_write_text(Path(args.out) / "gemv_bench.json",
                      json.dumps({"bandwidth_tb_s": bandwidth / 1e12, "rows": rows}, indent=2) + "\n")
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; us a call (fraction of the byte floor)")
    print(f"{'projection':28s} {'N x K':>12s} {'MB':>6s} {'cuBLAS':>14s} {'best gemv':>14s}  config   gemv/cuBLAS")
    print("(each after its producer kernel, the producer's own time subtracted)")
    for r in rows:
        cb, best = r["us"]["cublas"], r["best"]
        kb = r["us"][best] if best else float("nan")
        nopdl = next((t for lab, t in r["us"].items() if lab.endswith("no-pdl")), float("nan"))
        print(f"{r['name']:28s} {r['n']:>6d}x{r['k']:<5d} {r['mbytes']:6.1f} {cb:7.1f} ({r['floor_us'] / cb:4.0%}) "
              f"{kb:7.1f} ({r['floor_us'] / kb:4.0%})  {best}  {kb / cb:.3f}  no-pdl {nopdl:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
