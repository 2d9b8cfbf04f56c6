"""The MoE kernels on the GPU, in one call: parity of the Triton MoE against the fp32 oracle, then every
contender timed side by side under CUDA graphs, reported as microseconds and as a fraction of
the bytes-read floor at the copy bandwidth measured in the same run; optionally a launch-config
sweep whose winners are printed as `TUNED` entries for impl/moe/moe_launch_config.py.

    python scripts/gpu/bench_moe.py [--tune [--tune-budget-s 180] [--write-configs]] [--ms 1,4]
        [--shapes ling-3.0-flash,ling-flash-2.0] [--formats mxfp4,bf16] [--out DIR]
        [--paths dot,gemv] [--sweeps lookahead,shared,pdl,stages,tiles,warps] [--from-committed]

Tuning (`tune`) is per (shape, format, M), timing the whole layer: first the product path
(tensor cores; for M <= 4 also the register path, MXFP4 through dp4a products), each with three
tile presets (or only the committed config), then for the winner the sweeps named (`--sweeps`,
see `tune`), within a shared time budget. Routing variants (fewer warps, more experts a
program) are timed beside the default routing.

Each timed call is captured 10 times per graph with 10 different inputs (so the chosen experts
differ and the weights stream from HBM, not L2); the figure is the median replay time / 10.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from impl.model.config import get_config
from impl.moe.moe_launch_config import TABLE, MoELaunchConfig, lookup, m_bucket
from impl.launch_tables import device_name
from impl import backends
from impl.moe.gather import moe_gather
from impl.moe.humming import humming_layer
from impl.moe.reference import moe_reference
from impl.moe.random_layer import (bytes_per_token, distinct_experts, random_inputs, random_moe_block,
                                   shared_of)
from impl.moe.shared import SharedExpert
from impl.moe.triton_backend import moe_experts, moe_triton_layer, route_chunk, split_buffers
from impl.moe.triton_launch import plan
from impl.moe.triton_routing import route_triton
from impl.quant.mxfp4 import MXFP4Tensor
from impl.gpu_timing import copy_bandwidth, graph_us

CALLS_PER_GRAPH = 10
DEV = torch.device("cuda")


def log(*args):
    print(*args, flush=True)


def eager_us(calls) -> float:
    it = itertools.cycle(calls)
    ms = triton.testing.do_bench(lambda: next(it)(), warmup=25, rep=200, return_mode="median")
    return ms * 1e3


def build_block(cfg, fmt: str, seed: int):
    return random_moe_block(cfg, fmt, DEV, "triton", seed)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def parity(block, cfg, fmt: str, rows: list) -> None:
    gu, dn = block.experts.weights()
    sh = shared_of(block)
    for m in (1, 2, 4, 16):
        x = torch.randn(m, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            w_ref, ids_ref = block.gate(x)
            slots, w, ids = route_triton(x, block.gate.weight, block.gate.e_score_correction_bias, cfg)
            same_ids = torch.equal(ids.long().sort(-1).values, ids_ref.sort(-1).values)
            out = moe_experts(x, slots, gu, dn, sh)
            ref = moe_reference(x.float(), w_ref, ids_ref, gu, dn,
                                SharedExpert(sh.gate.float(), sh.up.float(), sh.down.float()))
        err = rel_err(out, ref)
        rows.append(dict(kind="parity", shape=cfg.name, fmt=fmt, M=m, rel_err=err, routing_ids_equal=same_ids,
                         finite=bool(torch.isfinite(out).all())))
        log(f"parity {cfg.name:15s} {fmt:5s} M={m:2d} rel_err={err:.2e} ids_equal={same_ids}")


def inputs(cfg, m: int):
    return random_inputs(cfg, m, CALLS_PER_GRAPH, DEV)


def humming_calls(block, cfg, xs, rows, m):
    """Humming's two GEMMs alone, on routing prepared before the timing (its reference figures)."""
    from humming.testing.data import generate_moe_tensors
    gu, dn = block.experts.weights()
    gate_up, down = humming_layer(gu), humming_layer(dn)
    calls, checks = [], []
    for x in xs:
        with torch.no_grad():
            _, ids = block.gate(x)
        _, _, sorted_ids, expert_ids, padded = generate_moe_tensors(ids.int(), cfg.num_experts, "indexed",
                                                                    block_size_config=8)
        act = torch.randn(m * cfg.top_k, cfg.moe_intermediate_size, device=DEV, dtype=torch.bfloat16)

        def call(x=x, sorted_ids=sorted_ids, expert_ids=expert_ids, padded=padded, act=act):
            y = gate_up(x, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                        top_k=cfg.top_k, compute_config={"gemm_type": "indexed"})
            z = down(act, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                     top_k=1, compute_config={"gemm_type": "indexed"})
            return y, z
        calls.append(call)
        checks.append((x, ids))
    # Humming's gate_up output for the first input against x W^T on our dequantized weights.
    x, ids = checks[0]
    y, _ = calls[0]()
    ref = torch.stack([x[t].float() @ MXFP4Tensor(gu.packed[e], gu.scales[e]).dequantize().T
                       for t in range(m) for e in ids[t].tolist()])
    rows.append(dict(kind="parity", shape=cfg.name, fmt="mxfp4", M=m, contender="humming gate_up",
                     rel_err=rel_err(y.view(m * cfg.top_k, -1), ref)))
    log(f"parity humming gate_up {cfg.name} M={m}: rel_err={rows[-1]['rel_err']:.2e}")
    return calls


def humming_whole_layer(block, cfg, xs, rows, m):
    """The `humming` backend's whole layer (impl/moe/humming.py: our Triton routing, its routing
    preparation, Humming's GEMMs, SwiGLU, combine, the shared expert on a side stream), checked
    against the oracle on the first input."""
    layer = backends.get("moe", "humming").layer
    gu, dn = block.experts.weights()
    sh = shared_of(block)
    with torch.no_grad():
        out = layer(xs[0], block.gate, gu, dn, sh)
        w, ids = block.gate(xs[0])
        ref = moe_reference(xs[0].float(), w, ids, gu, dn, SharedExpert(sh.gate.float(), sh.up.float(), sh.down.float()))
    rows.append(dict(kind="parity", shape=cfg.name, fmt="mxfp4", M=m, contender="humming whole layer",
                     rel_err=rel_err(out, ref)))
    log(f"parity humming whole layer {cfg.name} M={m}: rel_err={rows[-1]['rel_err']:.2e}")
    return [lambda x=x: layer(x, block.gate, gu, dn, sh) for x in xs]


# route_triton's launch variants, timed beside the default (4 warps each kernel, 2 experts a program).
ROUTING_VARIANTS = {"top-k 1 warp": dict(topk_warps=1), "logits 2 warps": dict(logits_warps=2),
                    "4 experts a program": dict(block_e=4), "8 experts a program": dict(block_e=8)}


def layer_routing(block, cfg, x, launch_cfg=None, split_in_router=True):
    """The layer's routing as the backend runs it (`route_chunk`), with an explicit launch config
    (None: the committed one). Returns what the expert kernels take: (launch config, x split or
    None, slots)."""
    p = plan(x.shape[0], cfg.top_k, *block.experts.weights(), x.device, launch_cfg)
    x_split, slots = route_chunk(x, block.gate, p, split_in_router)
    return p.config, x_split, slots


def layer_call(block, cfg, x, launch_cfg=None, split_in_router=True):
    """The whole layer as the backend runs it (`moe_triton_layer`); with `split_in_router` False,
    x split for the dp4a products in a launch of its own."""
    if split_in_router:
        return moe_triton_layer(x, block.gate, *block.experts.weights(), shared_of(block), launch_cfg)
    lc, _, slots = layer_routing(block, cfg, x, launch_cfg, split_in_router=False)
    return moe_experts(x, slots, *block.experts.weights(), shared_of(block), lc)


def time_contenders(block, cfg, fmt, m, bw, rows, tuned_cfg=None, routing_variants=False):
    xs = inputs(cfg, m)
    distinct = distinct_experts(block, xs)
    nbytes = bytes_per_token(cfg, fmt, distinct)
    whole = sum(nbytes.values())
    gu, dn = block.experts.weights()
    sh = shared_of(block)
    gate = block.gate

    def ours(x, split_in_router=True):
        return layer_call(block, cfg, x, tuned_cfg, split_in_router)

    def experts_only(x):
        """The expert kernels alone, on slots (and x split) the routing made before the timing:
        beside the whole layer, what the routing adds to the layer's critical path."""
        with torch.no_grad():
            lc, split, slots = layer_routing(block, cfg, x, tuned_cfg)
        return lambda: moe_experts(x, slots, gu, dn, sh, lc, x_split=split)

    contenders = {"triton (ours, whole layer)": [lambda x=x: ours(x) for x in xs],
                  "triton (ours), routing only": [
                      lambda x=x: route_triton(x, gate.weight, gate.e_score_correction_bias, cfg) for x in xs]}
    try:
        contenders["triton (ours), experts only"] = [experts_only(x) for x in xs]
    except Exception as e:  # a contender that cannot be set up is reported, the others still run
        log(f"experts only: {type(e).__name__}: {e}")
    if tuned_cfg is None and plan(m, cfg.top_k, gu, dn, DEV).config != MoELaunchConfig():
        # What the committed config (this device's, or a sibling's: impl.launch_tables.config_devices)
        # gains over the defaults an untuned device runs.
        contenders["triton (ours), untuned defaults"] = [lambda x=x: layer_call(block, cfg, x, MoELaunchConfig())
                                                         for x in xs]
    if split_buffers(xs[0], plan(m, cfg.top_k, gu, dn, DEV, tuned_cfg)) is not None:
        contenders["triton (ours), x split in own launch"] = [lambda x=x: ours(x, False) for x in xs]
    if routing_variants:
        for name, kw in ROUTING_VARIANTS.items():
            with torch.no_grad():
                _, w0, ids0 = route_triton(xs[0], gate.weight, gate.e_score_correction_bias, cfg)
                _, w1, ids1 = route_triton(xs[0], gate.weight, gate.e_score_correction_bias, cfg, **kw)
            same = torch.equal(ids0, ids1) and torch.allclose(w0, w1, rtol=1e-5, atol=0)
            log(f"routing variant {name}: same ids and weights as the default: {same}")
            if same:
                contenders[f"triton (ours), routing {name}"] = [
                    lambda x=x, kw=kw: route_triton(x, gate.weight, gate.e_score_correction_bias, cfg, **kw)
                    for x in xs]
    if fmt == "bf16":
        def gathered(x):
            w, ids = gate(x)
            return moe_gather(x, w, ids, gu, dn) + F.linear(F.silu(F.linear(x, sh.gate)) * F.linear(x, sh.up), sh.down)
        compiled = torch.compile(gathered, dynamic=False)
        contenders["gather+einsum eager"] = [lambda x=x: gathered(x) for x in xs]
        contenders["gather+einsum torch.compile"] = [lambda x=x: compiled(x) for x in xs]
    else:
        for name, build in (("humming (whole layer)", humming_whole_layer), ("humming (2 GEMMs only)", humming_calls)):
            try:
                contenders[name] = build(block, cfg, xs, rows, m)
            except Exception as e:  # the peer is optional: report why it did not run
                log(f"{name} unavailable: {type(e).__name__}: {e}")
                traceback.print_exc()
    results = {}
    for name, calls in contenders.items():
        try:
            with torch.no_grad():
                us = graph_us(calls)
            part = {"2 GEMMs only": nbytes["routed"], "experts only": whole - nbytes["router"],
                    "routing": nbytes["router"]}
            floor = next((v for k, v in part.items() if k in name), whole) / bw * 1e6
            results[name] = us
            rows.append(dict(kind="time", shape=cfg.name, fmt=fmt, M=m, contender=name, us=us, floor_us=floor,
                             frac_floor=floor / us, distinct_experts=distinct))
            log(f"time {cfg.name:15s} {fmt:5s} M={m:2d} {name:32s} {us:9.1f} us  floor {floor:6.1f} us "
                f"({floor / us:5.1%})")
        except Exception as e:
            log(f"time {name} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
    try:
        with torch.no_grad():
            us = eager_us([lambda x=x: ours(x) for x in xs])
        rows.append(dict(kind="time", shape=cfg.name, fmt=fmt, M=m, contender="triton (ours), not captured", us=us))
        log(f"time {cfg.name:15s} {fmt:5s} M={m:2d} {'triton (ours), not captured':32s} {us:9.1f} us")
    except Exception as e:
        log(f"uncaptured timing failed: {e}")
    return results


# Product paths: tensor cores, and for M <= 4 register multiply-adds (MXFP4 through dp4a products).
PATHS = {"dot": dict(gemv_max_tokens=0), "gemv": dict(gemv_max_tokens=4)}
# Each path is tried with these tiles (the M=1 MXFP4 winner of the first tuning, and the defaults)
# before the tiles of the winning path are swept.
# (The shared expert's K tile is set apart from the routed tiles', so that on the register path its
# bf16 loop does not decide the kernels' register count for every preset.)
TILE_PRESETS = [dict(gate_up_block_n=16, gate_up_block_k=512, down_block_n=16, down_block_k=256, shared_block_k=128),
                dict(gate_up_block_n=32, gate_up_block_k=128, down_block_n=32, down_block_k=128, shared_block_k=128),
                dict(gate_up_block_n=32, gate_up_block_k=512, down_block_n=16, down_block_k=256, shared_block_k=128)]
# The shared expert's split and K tile together: more programs a block allow longer K steps at
# the same registers a thread, and fewer steps are fewer memory round trips in a row.
SWEEP_SHARED = [dict(shared_split=s, shared_block_k=k) for s, k in itertools.product((1, 2, 4, 8), (64, 128, 256, 512))]
SWEEP_GATE_UP = [dict(gate_up_block_n=n, gate_up_block_k=k)
                 for n, k in itertools.product((16, 32, 64), (128, 256, 512, 1024))]
SWEEP_DOWN = [dict(down_block_n=n, down_block_k=k)
              for n, k in itertools.product((16, 32, 64, 128), (128, 256, 512, 1024))]
SWEEP_WARPS = [dict(gate_up_warps=w) for w in (2, 4, 8)] + [dict(down_warps=w) for w in (2, 4, 8)]
# Tensor-core path: stages of Triton's software pipeline (the weight tiles in flight in shared
# memory), each kernel its own; a stage more is a tile more of bytes in flight per program.
SWEEP_STAGES = [dict(gate_up_stages=s) for s in (2, 4, 5, 6)] + [dict(down_stages=s) for s in (2, 4, 5, 6)]
# How far ahead the register loops load: one or two K steps, each kernel its own, or none.
SWEEP_LOOKAHEAD = [dict(gate_up_lookahead=g, down_lookahead=d) for g, d in ((1, 1), (2, 1), (2, 2), (1, 2), (0, 0))]
# The shared expert's gate_up loop on its own.
SWEEP_SHARED_LOOKAHEAD = [dict(shared_lookahead=s) for s in (1, 2, 0)]
SWEEP_PDL = [dict(pdl=True, l2_prefetch=False), dict(pdl=True, l2_prefetch=True), dict(pdl=False, l2_prefetch=False)]
# The sweeps by name (`--sweeps`, run in the order given, a name may come twice: the best
# look-ahead depends on the tiles' registers). By default cheap and decisive ones first: a
# tuning out of time skips the rest.
SWEEPS = {"lookahead": (SWEEP_LOOKAHEAD, SWEEP_SHARED_LOOKAHEAD), "shared": (SWEEP_SHARED,), "pdl": (SWEEP_PDL,),
          "stages": (SWEEP_STAGES,), "tiles": (SWEEP_GATE_UP, SWEEP_DOWN), "warps": (SWEEP_WARPS,)}
TUNE_REL_ERR = 5e-2  # a candidate further than this from the default config's output is wrong, not fast


def paths_for(m: int, only: frozenset | None = None) -> dict:
    """The product paths worth timing at M tokens (the register path only up to 4 tokens);
    `only` narrows them to those names."""
    paths = {k: v for k, v in PATHS.items() if k == "dot" or m <= 4}
    return {k: v for k, v in paths.items() if only is None or k in only}


def tune(block, cfg, fmt, m, rows, deadline: float = float("inf"), only: frozenset | None = None,
         sweeps: tuple = tuple(SWEEPS), from_committed: bool = False) -> MoELaunchConfig:
    """Coordinate search for M tokens, timing the whole layer (routing included, so that the
    launches' overlap counts): each product path (see `paths_for`) with each tile preset (or,
    `from_committed`, the committed config alone), then, for the winner, the named `sweeps` in the
    order given (`SWEEPS`): (register path) loading one or two K steps ahead or not, (register
    path, with a shared expert) its split and K tile, launches overlapping (PDL) or not, with or
    without L2 prefetch, (tensor-core path) the pipeline's stages, the gate_up and down tiles,
    and the warps.
    Candidates that fail to compile or disagree with the default config's output are skipped.
    Shorter timing than the contenders' (do_bench rep 80 ms): about 20 to 27 configs a call.
    Past `deadline` (time.time()) the remaining sweep candidates are skipped (the path stage always
    runs whole) and the best so far wins."""
    xs = inputs(cfg, m)
    sh = shared_of(block)
    with torch.no_grad():
        expected = layer_call(block, cfg, xs[0], MoELaunchConfig()).float()
    best, best_us = None, float("inf")

    def measure(c):
        with torch.no_grad():
            err = rel_err(layer_call(block, cfg, xs[0], c), expected)
            if not err <= TUNE_REL_ERR:
                raise ValueError(f"output differs from the default config's by {err:.2e}")
            return graph_us([lambda x=x: layer_call(block, cfg, x, c) for x in xs], warmup=10, rep=80)

    skipped = []

    def consider(fields, label, always=False):
        nonlocal best, best_us
        if not always and time.time() > deadline:
            skipped.append(label)
            return
        try:
            c = MoELaunchConfig(**fields)  # some paths rule some tiles out (register path: gate_up blocks >= 32)
            us = measure(c)
        except Exception as e:  # e.g. out of shared memory for a large tile, or unsupported on this GPU
            log(f"  {label} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            return
        log(f"  {label}: {us:.1f} us")
        rows.append(dict(kind="tune-step", shape=cfg.name, fmt=fmt, M=m, label=label, layer_us=us))
        if us < best_us:
            best, best_us = c, us

    if from_committed:
        committed = lookup(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k, m, fmt, DEV)
        consider(dataclasses.asdict(committed), "committed", always=True)
    else:
        for name, path in paths_for(m, only).items():
            for i, tiles in enumerate(TILE_PRESETS):
                consider({**path, **tiles}, f"path {name} tiles {i}", always=True)
    if best is None:
        raise RuntimeError(f"no configuration ran for {cfg.name} {fmt} M={m}")
    gemv = best.gemv_max_tokens >= m
    applies = {"shared": gemv and sh is not None, "lookahead": gemv, "stages": not gemv}
    for sweep in (sw for name in sweeps if applies.get(name, True) for sw in SWEEPS[name]):
        for params in sweep:
            cand = {**dataclasses.asdict(best), **params}
            if cand != dataclasses.asdict(best):
                consider(cand, str(params))
    if skipped:
        log(f"  past this tuning's time budget: skipped {len(skipped)} candidates ({skipped[0]} ...)")
    rows.append(dict(kind="tuned", shape=cfg.name, fmt=fmt, M=m, layer_us=best_us, config=best.__dict__,
                     skipped=len(skipped)))
    log(f"tuned {cfg.name} {fmt} M={m}: layer {best_us:.1f} us with {best}")
    return best


def parse_paths(value: str) -> frozenset | None:
    names = frozenset(v for v in value.split(",") if v)
    unknown = names - set(PATHS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown product paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    return names or None


def parse_sweeps(value: str) -> tuple:
    names = tuple(v for v in value.split(",") if v)
    unknown = set(names) - set(SWEEPS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown or no sweeps {sorted(unknown)}; known: {', '.join(SWEEPS)}")
    return names


def tuned_buckets(m: int, ms: list[int]) -> set[int]:
    """M buckets a winner at M tokens is registered for: its own, and for M=1 also bucket 2 unless
    M=2 was tuned itself (the M=4 winner serves bucket 4 only: 8 and 16 only when measured)."""
    return {m_bucket(m)} | ({2} if m == 1 and not any(m_bucket(v) == 2 for v in ms) else set())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="ling-3.0-flash,ling-flash-2.0")
    ap.add_argument("--formats", default="mxfp4,bf16")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--write-configs", action="store_true",
                    help="merge the tuned configs into impl/moe/tuned_configs.json (after each tuning)")
    ap.add_argument("--paths", default="", type=parse_paths,
                    help=f"comma-separated product paths the tuning tries (default: all of {', '.join(PATHS)})")
    ap.add_argument("--sweeps", default=",".join(SWEEPS), type=parse_sweeps,
                    help="comma-separated sweeps after the path stage (default: %(default)s)")
    ap.add_argument("--from-committed", action="store_true",
                    help="start the sweeps from the committed config instead of the path stage")
    ap.add_argument("--skip-contenders", action="store_true",
                    help="tune only: time no contenders (a tuning run's time goes to the tuning)")
    ap.add_argument("--tune-budget-s", type=float, default=180.0,
                    help="seconds for all tuning together, shared equally by the (shape, format, M) "
                         "tunings still to run; a tuning past its share keeps its best so far")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows: list = [dict(kind="bandwidth", bytes_per_s=bw)]
    tuned = {}
    t0 = time.time()
    tunings_left = len(args.shapes.split(",")) * len(args.formats.split(",")) * len(args.ms.split(","))
    tune_end = t0 + args.tune_budget_s
    for shape in args.shapes.split(","):
        cfg = get_config(shape)
        formats = args.formats.split(",")
        for fmt in formats:
            block = build_block(cfg, fmt, seed=0)
            try:
                parity(block, cfg, fmt, rows)
            except Exception as e:
                log(f"parity failed: {type(e).__name__}: {e}")
                traceback.print_exc()
            ms = [int(v) for v in args.ms.split(",")]
            for m in ms:
                cfg_m = None
                if args.tune:  # each M gets its own winner (a verify step is not a decode step)
                    share = max(0.0, tune_end - time.time()) / tunings_left
                    tunings_left -= 1
                    try:
                        cfg_m = tune(block, cfg, fmt, m, rows, deadline=time.time() + share, only=args.paths,
                                     sweeps=args.sweeps, from_committed=args.from_committed)
                    except Exception as e:
                        log(f"tuning {cfg.name} {fmt} M={m} failed: {type(e).__name__}: {e}")
                        traceback.print_exc()
                if cfg_m is not None:
                    new = {}
                    for bucket in tuned_buckets(m, ms):
                        key = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k, bucket,
                               fmt, device_name(DEV))
                        new[key] = cfg_m
                    tuned.update(new)
                    if args.write_configs:  # now, so that a run cut short by a timeout keeps it
                        TABLE.save(new)
                if not args.skip_contenders:
                    time_contenders(block, cfg, fmt, m, bw, rows, cfg_m, routing_variants=fmt == formats[0])
            del block
            torch.cuda.empty_cache()
            log(f"[{time.time() - t0:.0f} s elapsed]")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_moe.json").write_text(json.dumps(rows, indent=1, default=str))
    log("\n== summary (us per call under CUDA graphs; floor = bytes read / copy bandwidth) ==")
    for r in rows:
        if r["kind"] == "time":
            frac = f"{r['frac_floor']:6.1%}" if "frac_floor" in r else "      "
            log(f"{r['shape']:15s} {r['fmt']:5s} M={r['M']:2d} {r['contender']:32s} {r['us']:9.1f} us {frac}")
    for key, c in tuned.items():
        log(f"TUNED[{key!r}] = {c!r}")
    if tuned and args.write_configs:
        log(f"wrote {len(tuned)} tuned config(s) into {TABLE.path}")


if __name__ == "__main__":
    main()
