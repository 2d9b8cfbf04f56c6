#!/usr/bin/env python3
"""The full-depth Ling-3.0-flash on one GPU: build it with random weights in the checkpoint formats
(routed experts MXFP4, drawn and quantized a few experts at a time; the rest bf16; FP8 head),
time the build and its peak memory, prefill a prompt, then capture one greedy decode step (all 42
layers and the head) in one CUDA graph and time its replay (median, triton.testing.do_bench) at
each context. Prints a short table; writes DIR/ling_flash.json with --out DIR.

    python3 scripts/gpu/ling_flash.py --out $OUT [--contexts 1024,8192,32768] [--prompt 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from impl.decode_runner import PlainRunner
from impl.gpu_timing import copy_bandwidth, graph_us
from impl.model.build import build_model, weight_bytes
from pytest_moeperf.baselines import atomic_write_text

CACHE_SLACK = 64  # cache rows past the last position used (a timed step's context, a profiled prompt)


def cuda_device() -> torch.device | None:
    """The CUDA device the Ling scripts run on; None, saying so on stderr, where there is none
    (their mains then exit 2)."""
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    return torch.device("cuda")


def build_row3(dev: torch.device):
    """Ling-3.0-flash as the ladder's row 3 runs it: random weights, MXFP4 experts through this
    project's Triton MoE, bf16 projections, the FP8 head."""
    return build_model("ling-3.0-flash", dev, torch.bfloat16, moe_backend="triton", experts="mxfp4", head="fp8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--prompt", type=int, default=1024, help="tokens prefilled before the timed steps")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    dev = cuda_device()
    if dev is None:
        return 2
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_row3(dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    c = model.config
    row = dict(build_s=round(build_s, 1), weights_gib=round(weight_bytes(c, torch.bfloat16, "mxfp4") / 2**30, 2),
               peak_build_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               attention=f"{c.attention_types.count('kda')} kda + {c.attention_types.count('mla')} mla")
    print(f"built in {build_s:.1f} s, peak {row['peak_build_gib']} GiB, {row['attention']}", flush=True)
    model.setup_caches(1, c.max_seq_len)
    gen = torch.Generator(device=dev).manual_seed(0)
    prompt = torch.randint(0, c.vocab_size, (1, args.prompt), device=dev, generator=gen)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(prompt, torch.arange(args.prompt, device=dev))
        torch.cuda.synchronize()
        row["prefill_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
        row["prefill_finite"] = bool(torch.isfinite(logits).all())
    print(f"prefill of {args.prompt} tokens: {row['prefill_ms']} ms (eager, first call includes compiles)", flush=True)
    bw = copy_bandwidth(dev)
    row["copy_bandwidth_tb_s"] = round(bw / 1e12, 3)
    steps = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        # Caches as long as the run needs (gpt-fast's fixed max_seq_len per run): MLA's decode
        # attends over the whole static cache, masked, so a cache of the model's full context
        # would be read at every context.
        step = PlainRunner(model, capacity=min(c.max_seq_len, ctx + CACHE_SLACK)).held_step(ctx)
        with torch.inference_mode():
            us = graph_us([step])
        steps.append(dict(context=ctx, step_us=round(us, 1)))
        print(f"decode step at context {ctx}: {us:.1f} us (one CUDA graph)", flush=True)
    row["decode"] = steps
    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.out:
        atomic_write_text(Path(args.out) / "ling_flash.json", json.dumps(row, indent=2) + "\n")
    print("\n| build s | peak GiB | weights GiB | prefill ms | " + " | ".join(f"step us @{s['context']}" for s in steps) + " |")
    print(f"| {row['build_s']} | {row['peak_gib']} | {row['weights_gib']} | {row['prefill_ms']} | "
          + " | ".join(str(s["step_us"]) for s in steps) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
