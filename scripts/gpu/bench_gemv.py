#!/usr/bin/env python3
"""The decode step's bf16 projections (one token) through cuBLAS and through the FP8 head's GEMV
kernel on its 16-bit tensor-core path, side by side on a CUDA GPU, against their byte floor.

Why: at Ling-3.0-flash shapes cuBLAS reads KDA's fused input projection at 63% of the copy
bandwidth and o_proj at 32% (notes/ling.md); those GEMVs are most of the step's distance from its
floor (notes/ling-ladder.md). `impl.head.fp8_gemv.fp8_gemv_kernel` with PATH 1 ("dot") upcasts its
weight tile to the activations' dtype before a 16-bit tensor-core dot: for a bf16 weight that
upcast is the identity, so the tile goes from memory to the tensor cores unconverted, as the FP8
head's own path does at 97% of its floor. Its scale is one fp32 1.0 (per tensor): exact.

Weights: each projection of one KDA and one MLA layer at Ling-3.0-flash shapes (the fused input
projections as build_model leaves them, and o_proj) and the dense MLP's, random normal * 0.02 in
bf16; COPIES copies of each, cycled inside one captured graph so that every call reads its weight
from HBM (o_proj's 21 MB would otherwise sit in the 50 MB L2). Each variant is checked against an
fp32 product first (relative error <= 1e-2: bf16 output rounding is 4e-3) and skipped, saying so,
where it is wrong. Timing: `impl.gpu_timing.interleaved_replay_us` (cuBLAS and every kernel
config take turns, ROUNDS rounds), microseconds per call, as a fraction of the weight's bytes at
the copy bandwidth measured in the same process.

    PYTHONPATH=. python3 scripts/gpu/bench_gemv.py --out $OUT      # from the repository root
Prints a table last; writes DIR/gemv_bench.json. Exit status 0; 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import build_kda, build_mla  # noqa: E402
from impl.head.configs import DOT_ROWS, GemvConfig  # noqa: E402

COPIES = 6  # weights cycled per replay: 6 x 21 MB > 2 x the H200's 50 MB L2
ROUNDS, REP_MS = 3, 50
# The sweep: rows a program, hidden elements a loop step, warps, pipeline stages (32 configs, each
# compiled once: N and K are not constexprs, and every K here is a multiple of BLOCK_K).
BLOCK_N = (16, 32, 64, 128)
BLOCK_K = (256, 512)
WARPS = (4, 8)
STAGES = (3, 5)
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


def configs() -> list[GemvConfig]:
    return [GemvConfig(bn, bk, w, s, path="dot") for bn, bk, w, s in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES)]


def kernel_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, one: torch.Tensor, cfg: GemvConfig):
    from impl.head.fp8_gemv import fp8_gemv_kernel
    from impl.triton_env import FP32_MATH, triton
    n, k = w.shape
    grid = (triton.cdiv(n, cfg.block_n), 1)
    return lambda: fp8_gemv_kernel[grid](
        x, w, one, out, 1, n, k, x.stride(0), w.stride(0), out.stride(0), PER_ROW=False, BLOCK_M=DOT_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PATH=1, EVEN_K=k % cfg.block_k == 0, IEEE_DOT=False,
        FP32_MATH=FP32_MATH, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def bench_shape(name: str, n: int, k: int, bandwidth: float, gen: torch.Generator) -> dict:
    from impl.gpu_timing import interleaved_replay_us
    from impl.graphs import capture_graph
    dev = torch.device("cuda")
    ws = [torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen) for _ in range(COPIES)]
    x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
    one = torch.ones((), device=dev)
    ref = (x.float() @ ws[0].float().t())
    outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    calls = {"cublas": [lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)]}
    rejected = {}
    for cfg in configs():
        label = f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        try:
            outs[0].fill_(float("nan"))
            kernel_call(x, ws[0], outs[0], one, cfg)()
            rel = float((outs[0].float() - ref).norm() / ref.norm())
            if not rel <= MAX_REL:
                rejected[label] = f"relative error {rel:.2e}"
                continue
        except Exception as e:  # a config the compiler refuses (shared memory, registers)
            rejected[label] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        calls[label] = [kernel_call(x, w, o, one, cfg) for w, o in zip(ws, outs)]
    with torch.inference_mode():
        graphs = {label: capture_graph(fns) for label, fns in calls.items()}
        times = interleaved_replay_us(graphs, rounds=ROUNDS, rep=REP_MS)
    per_call = {label: sorted(t)[len(t) // 2] / COPIES for label, t in times.items()}
    floor = n * k * 2 / bandwidth * 1e6
    best = min((label for label in per_call if label != "cublas"), key=per_call.get, default=None)
    return {"name": name, "n": n, "k": k, "mbytes": n * k * 2 / 1e6, "floor_us": floor, "us": per_call,
            "best": best, "rejected": rejected}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gemv_bench.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA device", file=sys.stderr)
        return 2
    from impl.gpu_timing import copy_bandwidth
    from pytest_moeperf.baselines import atomic_write_text
    bandwidth = copy_bandwidth("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [bench_shape(name, n, k, bandwidth, gen) for name, (n, k) in projections().items()]
    atomic_write_text(Path(args.out) / "gemv_bench.json",
                      json.dumps({"bandwidth_tb_s": bandwidth / 1e12, "rows": rows}, indent=2) + "\n")
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; us a call (fraction of the byte floor)")
    print(f"{'projection':28s} {'N x K':>12s} {'MB':>6s} {'cuBLAS':>14s} {'best kernel':>14s}  config   kernel/cuBLAS")
    for r in rows:
        cb = r["us"]["cublas"]
        best = r["best"]
        kb = r["us"][best] if best else float("nan")
        print(f"{r['name']:28s} {r['n']:>6d}x{r['k']:<5d} {r['mbytes']:6.1f} {cb:7.1f} ({r['floor_us'] / cb:4.0%}) "
              f"{kb:7.1f} ({r['floor_us'] / kb:4.0%})  {best}  {kb / cb:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
