#!/usr/bin/env python3
"""Kernel by kernel, one decode token of a Ling-3.0-flash KDA or MLA layer (bench_attention's
cases, eager, after warm-up) under torch.profiler: each CUDA kernel's name, count and device time,
to say which of a step's kernels its time goes to. Prints a table per layer kind and context.
With --graph the call is captured in a CUDA graph and its replays profiled, as a decode step
runs it (PDL launches then start early, so their device times include the wait for the one before),
and the replay's median wall time is printed beside the summed kernel time.

    python3 scripts/gpu/profile_attention.py [--kinds kda,mla] [--contexts 1024,32768] [--graph]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import kda_cases, mla_cases  # noqa: E402

import triton.testing  # noqa: E402

from impl.graphs import capture_graph  # noqa: E402

CASES = {"kda": (kda_cases, "step"), "mla": (mla_cases, "absorbed")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--graph", action="store_true", help="profile replays of the call captured in a CUDA graph")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev, gen = torch.device("cuda", 0), torch.Generator(device="cuda").manual_seed(0)
    for kind in args.kinds.split(","):
        cases, form = CASES[kind]
        for ctx in (int(c) for c in args.contexts.split(",")):
            fn = next(f for row, f in cases(ctx, torch.bfloat16, gen, dev) if row["form"] == form)
            wall = None
            if args.graph:
                with torch.inference_mode():
                    fn = capture_graph([fn]).replay
                wall = 1e3 * triton.testing.do_bench(fn, return_mode="median")  # L2 flushed, as bench_attention
            with torch.inference_mode():
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        fn()
                    torch.cuda.synchronize()
            rows = [(e.key, e.count // 10, e.device_time_total / 10) for e in prof.key_averages()
                    if e.device_time_total > 0]
            rows.sort(key=lambda r: -r[2])
            total = sum(r[2] for r in rows)
            replay = f", {wall:.1f} us a graph replay (median)" if wall is not None else ""
            print(f"\n== {kind} {form} L={ctx}: {sum(r[1] for r in rows)} kernels a call, {total:.1f} us of kernel time"
                  f"{replay}")
            for name, count, us in rows:
                print(f"  {us:7.1f} us  x{count:<3d} {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
