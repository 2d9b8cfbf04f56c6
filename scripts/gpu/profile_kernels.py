"""Where a captured step's time goes, kernel by kernel (CUPTI through torch.profiler), on the GPU:
the tiny model's decode step, its speculative step and that step's parts, and whole MoE layers
of the Ling shapes (ling-3.0-flash, ling-flash-2.0). Per step it prints the kernels (count, device us per step), the summed
kernel time and the replay's wall time per step: their difference is the launch gaps inside the
graph, which no kernel speed-up removes.

    python3 scripts/gpu/profile_kernels.py [--model tiny-gsm] [--moe-backend triton]
        [--moe-shapes ling-3.0-flash,ling-flash-2.0] [--ms 1,4] [--formats mxfp4,bf16]
        [--override pdl=false,... [--override ...]] [--without-shared]

Each --override runs the MoE tables again with those launch-config fields set in every committed
config (shapes nobody tuned keep the defaults; one process: the A/B of a few configs shares its weights and warm-up). Under Nsight
Compute (CUPTI taken) the tables are empty and only the wall times print.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from impl.graphs import StepGraph, capture_graph

REPLAYS = 20  # per window; a decode run of 40 steps fits the tiny model's cache


def kernel_table(title: str, replay, steps_per_replay: int = 1, reset=lambda: None) -> float:
    """Profile REPLAYS calls of `replay`; print the kernels per step; return wall us per step.
    `reset` (outside the timed windows) rewinds a step that advances a state."""
    reset()
    for _ in range(5):
        replay()
    reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            replay()
        torch.cuda.synchronize()
    reset()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        replay()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1e3 / REPLAYS / steps_per_replay
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        print(f"\n== {title}: wall {wall:.1f} us/step (no kernel events: another profiler holds CUPTI)")
        return wall
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in kernels:
        per[_short(ev.name)][0] += 1
        per[_short(ev.name)][1] += ev.device_time_total
    n = REPLAYS * steps_per_replay
    total = sum(v[1] for v in per.values()) / n
    count = sum(v[0] for v in per.values()) / n
    print(f"\n== {title}: wall {wall:.1f} us/step, kernels {count:.0f}/step summing {total:.1f} us "
          f"(gaps {wall - total:.1f} us)")
    for name, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"  {c / n:5.1f}x {us / n:8.2f} us  {name}")
    if count == int(count):
        timeline(kernels, int(count))
    return wall


def _short(name: str) -> str:
    return name if len(name) < 60 else name[:57] + "..."


def timeline(kernels, per_step: int) -> None:
    """Each kernel of a step as (start, end) from the step's first kernel start, means over the
    steps: with launches overlapping (PDL) durations include waits, but the ends show when each
    stage of the step is done, i.e. its critical path."""
    kernels = sorted(kernels, key=lambda ev: ev.time_range.start)  # launch order
    steps = [kernels[i:i + per_step] for i in range(0, len(kernels) - per_step + 1, per_step)]
    print(f"  timeline (us from the step's first kernel start, mean of {len(steps)} steps):")
    for j in range(per_step):
        start = sum(s[j].time_range.start - s[0].time_range.start for s in steps) / len(steps)
        end = sum(s[j].time_range.end - s[0].time_range.start for s in steps) / len(steps)
        print(f"    {start:7.2f} .. {end:7.2f}  {_short(steps[0][j].name)}")


def profile_model(name: str, moe_backend: str) -> None:
    from impl.data.arith import take
    from impl.model.build import build_model
    from impl.decode_runner import PlainRunner, Run, SpecRunner
    from impl.speculative import SpeculativeDecoder
    model = build_model(name, device="cuda", dtype=torch.bfloat16, moe_backend=moe_backend)
    prompt = torch.tensor(list(take("heldout", 1, seed=2)[0].prompt.encode("ascii")), device="cuda")
    plain = Run(PlainRunner(model), prompt, 40)
    name = f"{name} ({moe_backend} MoE)"
    kernel_table(f"{name} decode step", plain.runner.graph.graph.replay, reset=plain.reset)
    spec = Run(SpecRunner(SpeculativeDecoder(model, 3)), prompt, 40)
    kernel_table(f"{name} speculative step k=3", spec.runner.graph.graph.replay, reset=spec.reset)
    spec.reset()
    for part, graph in spec.runner.parts().items():
        kernel_table(f"{name} {part}", graph.graph.replay)


def profile_moe(shape: str, fmt: str, m: int, without_shared: bool = False, label: str = "",
                moe_backend: str = "triton") -> None:
    from impl.model.config import get_config
    from impl.moe.random_layer import random_inputs, random_moe_block
    cfg = get_config(shape)
    if without_shared:  # what the shared expert's programs cost the step
        cfg = dataclasses.replace(cfg, num_shared_experts=0)
    block = random_moe_block(cfg, fmt, torch.device("cuda"), moe_backend, 0)
    xs = random_inputs(cfg, m, 10, torch.device("cuda"))
    with torch.inference_mode():  # the block's forward: the backend's whole layer
        graph = capture_graph([lambda x=x: block(x[None]) for x in xs])
    backend = "" if moe_backend == "triton" else f" ({moe_backend})"
    kernel_table(f"MoE layer {shape} {fmt} M={m}{backend}{' without shared expert' if without_shared else ''}{label}",
                 graph.replay, steps_per_replay=len(xs))


def parse_override(value: str) -> dict:
    """"a=1,b=true" -> {"a": 1, "b": True} (ints, booleans, else strings), checked against
    MoELaunchConfig: an unknown field or a bad value is a usage error naming it."""
    from impl.moe.moe_launch_config import MoELaunchConfig
    fields = {f.name for f in dataclasses.fields(MoELaunchConfig)}
    out = {}
    for item in filter(None, value.split(",")):
        key, eq, v = item.partition("=")
        if not eq or key not in fields:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        out[key] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    try:
        MoELaunchConfig(**out)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-gsm")
    ap.add_argument("--moe-backend", default="triton")
    ap.add_argument("--moe-shapes", default="ling-3.0-flash,ling-flash-2.0")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--formats", default="mxfp4,bf16")
    ap.add_argument("--override", action="append", type=parse_override,
                    help="launch-config fields set in every committed MoE config, e.g. pdl=false "
                         "(to see each kernel's own duration, launches not overlapping); repeated: "
                         "the MoE tables once per override")
    ap.add_argument("--without-shared", action="store_true",
                    help="also time each MoE layer without its shared expert")
    args = ap.parse_args()
    from impl.moe import moe_launch_config
    committed = moe_launch_config.TUNED
    for override in args.override or [{}]:
        moe_launch_config.TUNED = {k: dataclasses.replace(c, **override) for k, c in committed.items()}
        label = f" [{', '.join(f'{k}={v}' for k, v in override.items())}]" if override else ""
        if args.model:
            profile_model(args.model, args.moe_backend)
        for shape in filter(None, args.moe_shapes.split(",")):
            for fmt in args.formats.split(","):
                for m in map(int, args.ms.split(",")):
                    for without in (False, True) if args.without_shared else (False,):
                        try:
                            profile_moe(shape, fmt, m, without, label, args.moe_backend)
                        except Exception as e:  # e.g. a config out of registers: the other tables still run
                            print(f"\n== MoE layer {shape} {fmt} M={m}{label}: failed: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}")


if __name__ == "__main__":
    main()
