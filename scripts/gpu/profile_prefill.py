#!/usr/bin/env python3
"""Where the prompt pass of the full-depth Ling-3.0-flash goes (the TTFT's bulk), on a CUDA GPU:
build the model with random weights (MXFP4 experts, FP8 head), prefill a prompt of each length
as serving does (the last position's logits only) twice to warm it up, then once with CUDA events around every layer's attention and MLP. Prints,
per prompt length, the wall time of the pass and the device time of each component kind (KDA
attention, MLA attention, routed MoE blocks, dense MLPs); the wall time past their sum is the
norms, the head, the embedding and the host's own time between launches. With --kernels, one
MoE layer's and one KDA layer's prompt pass at the first prompt length, kernel by kernel
(torch.profiler): device time and launches per kernel name, and the layer's wall time.

    PYTHONPATH=. python3 scripts/gpu/profile_prefill.py --out $OUT [--prompts 1024,8192] [--kernels]
Writes DIR/prefill_profile.json with --out DIR. Exit status 0; 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from impl.model.config import get_config  # noqa: E402
from ling_flash import CACHE_SLACK, build_row3, cuda_device  # noqa: E402
from pytest_moeperf.baselines import atomic_write_text  # noqa: E402


def _kind(layer, part: str) -> str:
    if part == "attention":
        return f"{type(layer.self_attn).__name__}"
    return "MoE" if hasattr(layer.mlp, "backend") else "dense MLP"


def profiled_prefill(model, prompt: torch.Tensor) -> dict:
    """One prompt pass with an event pair around each layer's attention and MLP: device ms by kind."""
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    handles = []
    for layer in model.layers:
        for part, module in (("attention", layer.self_attn), ("mlp", layer.mlp)):
            kind = _kind(layer, part)
            pair = {}

            def pre(_m, _a, pair=pair):
                pair["start"] = torch.cuda.Event(enable_timing=True)
                pair["start"].record()

            def post(_m, _a, _o, pair=pair, kind=kind):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((kind, pair["start"], end))

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(prompt, torch.arange(prompt.shape[1], device=prompt.device), last_logits=True)
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        for h in handles:
            h.remove()
    by_kind: dict[str, float] = collections.defaultdict(float)
    for kind, start, end in events:
        by_kind[kind] += start.elapsed_time(end)
    return dict(wall_ms=round(wall_ms, 1), **{k: round(v, 1) for k, v in sorted(by_kind.items())})


def layer_kernels(title: str, module, x: torch.Tensor, call, top: int = 12) -> None:
    """Print the kernels of `call(module, x)` (warmed up once): launches and device ms per name."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        call(module, x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            call(module, x)
            torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - t0)
    per: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:70]][0] += 1
            per[ev.name[:70]][1] += ev.device_time_total / 1e3
    total = sum(v[1] for v in per.values())
    print(f"\n== {title}: wall {wall_ms:.1f} ms, {sum(v[0] for v in per.values())} kernels summing {total:.1f} ms")
    for name, (n, ms) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {n:6d}x {ms:9.2f} ms  {name}")


def parse_prompts(text: str) -> list[int]:
    """`--prompts`: comma-separated token counts, each >= 2 (a prompt pass, not a decode step) and
    small enough for Ling-3.0-flash's cache with CACHE_SLACK rows to spare."""
    limit = get_config("ling-3.0-flash").max_seq_len - CACHE_SLACK
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompts takes comma-separated token counts, got {text!r}") from None
    bad = [n for n in counts if not 2 <= n <= limit]
    if bad:
        raise argparse.ArgumentTypeError(f"--prompts: {bad} outside 2..{limit} tokens (the model's context "
                                         f"less {CACHE_SLACK})")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=parse_prompts, default="1024,8192")
    ap.add_argument("--kernels", action="store_true", help="kernel tables of one MoE and one KDA layer")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    dev = cuda_device()
    if dev is None:
        return 2
    model = build_row3(dev)
    c = model.config
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in args.prompts:
        model.setup_caches(1, n + CACHE_SLACK)
        prompt = torch.randint(0, c.vocab_size, (1, n), device=dev, generator=gen)
        with torch.inference_mode():
            for _ in range(2):
                model(prompt, torch.arange(n, device=dev), last_logits=True)
        row = dict(prompt=n, **profiled_prefill(model, prompt))
        rows.append(row)
        print(row, flush=True)
    if args.kernels:
        n = args.prompts[0]
        model.setup_caches(1, n + CACHE_SLACK)
        x = torch.randn(1, n, c.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen) * 0.5
        moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "backend"))
        kda = next(layer.self_attn for layer in model.layers if type(layer.self_attn).__name__ == "KDAAttention")
        layer_kernels(f"one MoE layer, {n}-token prompt", moe, x, lambda m, h: m(h))
        layer_kernels(f"one KDA layer, {n}-token prompt", kda, x,
                      lambda m, h: m(h, None, None, torch.arange(h.shape[1], device=h.device)))
    if args.out:
        atomic_write_text(Path(args.out) / "prefill_profile.json", json.dumps(rows, indent=2) + "\n")
    kinds = sorted({k for r in rows for k in r if k not in ("prompt", "wall_ms")})
    print("\n| prompt | wall ms | " + " | ".join(f"{k} ms" for k in kinds) + " | rest ms |")
    for r in rows:
        rest = r["wall_ms"] - sum(r.get(k, 0.0) for k in kinds)
        print(f"| {r['prompt']} | {r['wall_ms']} | " + " | ".join(str(r.get(k, "")) for k in kinds) + f" | {rest:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
