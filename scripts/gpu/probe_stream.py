"""The streaming ceiling of one MoE layer's dependency chain, in Triton, on this GPU: how fast the
whole layer could be if its expert products cost nothing beyond their loads.

The copy-bandwidth floor (bytes / 4.24 TB/s) assumes one long stream. A decode layer is a chain
of short dependent phases: router logits (reads the router), top-k, gate_up (reads the chosen
experts' gate/up rows and the shared expert's), down (their down rows). Each phase reads a few to
a few tens of MB, so launch ramp, the first round trip and the tail weigh on it. This script
replaces each expert phase by a kernel that only loads the same bytes (same experts, chosen by
the real routing, same row layout; int32 sums, checked against torch) and times:

- each phase alone, over a sweep of tiles, warps and pipeline stages (rows: [rows, K] tiles as
  the expert kernels read them; flat: contiguous chunks, the most favourable access there is);
- the chain: the real routing, then the best gate_up and down stream kernels, with and without
  programmatic dependent launch (PDL), against our whole layer in the same process.

The chain's time is a ceiling for any Triton layer of this structure on this device: the expert
kernels can only add their arithmetic to it.

    python3 scripts/gpu/probe_stream.py [--shapes ling-3.0-flash,ling-flash-2.0] [--ms 1,4] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench_moe import (CALLS_PER_GRAPH, DEV, build_block, copy_bandwidth, graph_us, inputs,
                       layer_call, log)
from impl.model.config import get_config
from impl.moe.random_layer import FORMATS
from impl.moe.triton_pdl import pdl_release, pdl_wait
from impl.moe.triton_routing import route_triton
from impl.triton_env import tl, triton

WORD = 4  # bytes: the stream kernels read int32 words


@triton.jit
def _unit(pid, routed_ptr, shared_ptr, ids_ptr, routed_expert_words, n_slots, routed_units_per_slot,
          PDL: tl.constexpr):
    """Which matrix program `pid` reads: a routed slot's expert (after the routing: PDL wait
    first) or the shared expert (needs nothing before it). Returns (base, unit within matrix,
    routed?)."""
    n_routed = n_slots * routed_units_per_slot
    routed = pid < n_routed
    if routed:
        pdl_wait(PDL)
        eid = tl.load(ids_ptr + pid // routed_units_per_slot).to(tl.int64)
        base = routed_ptr + eid * routed_expert_words
        unit = pid % routed_units_per_slot
    else:
        base = shared_ptr
        unit = pid - n_routed
    return base, unit, routed


@triton.jit
def stream_rows_kernel(routed_ptr, shared_ptr, ids_ptr, out_ptr, routed_expert_words, n_slots, routed_units_per_slot,
                       routed_rows, routed_words, shared_rows, shared_words,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """[BLOCK_R, BLOCK_K] tiles of words over a block of rows, as the expert kernels read them."""
    pid = tl.program_id(0)
    base, unit, routed = _unit(pid, routed_ptr, shared_ptr, ids_ptr, routed_expert_words, n_slots,
                               routed_units_per_slot, PDL)
    rows = tl.where(routed, routed_rows, shared_rows)
    words = tl.multiple_of(tl.where(routed, routed_words, shared_words), 4)
    offs_r = unit * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int32)
    for k in tl.range(0, words, BLOCK_K, num_stages=STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask = (offs_r[:, None] < rows) & (offs_k[None, :] < words)
        acc += tl.load(base + offs_r[:, None].to(tl.int64) * words + offs_k[None, :], mask=mask, other=0)
    if not routed:
        pdl_wait(PDL)  # every program waits before the next launch may start (triton_pdl's rule)
    pdl_release(PDL)
    tl.store(out_ptr + pid * BLOCK_R + tl.arange(0, BLOCK_R), tl.sum(acc, 1))


@triton.jit
def stream_flat_kernel(routed_ptr, shared_ptr, ids_ptr, out_ptr, routed_expert_words, n_slots, routed_units_per_slot,
                       routed_chunk, shared_words, shared_chunk,
                       BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """A contiguous chunk of a matrix's words a program (each expert's matrix is contiguous)."""
    pid = tl.program_id(0)
    base, unit, routed = _unit(pid, routed_ptr, shared_ptr, ids_ptr, routed_expert_words, n_slots,
                               routed_units_per_slot, PDL)
    chunk = tl.where(routed, routed_chunk, shared_chunk)
    total = tl.where(routed, routed_expert_words, shared_words)
    start = unit.to(tl.int64) * chunk
    n = tl.minimum(chunk, total - start).to(tl.int32)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(base + start + offs, mask=offs < n, other=0)
    if not routed:
        pdl_wait(PDL)
    pdl_release(PDL)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def _sm_count() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count


class Phase:
    """One expert phase's bytes: a pool of routed matrices [E, rows, words] int32 (one per expert,
    contiguous) and one shared matrix [rows, words] (`shared_rows` 0: routed only)."""

    def __init__(self, name: str, experts: int, rows: int, row_bytes: int, shared_rows: int, shared_row_bytes: int):
        self.name = name
        gen = torch.Generator(device=DEV).manual_seed(7)
        words = -(-row_bytes // (4 * WORD)) * 4  # rows padded to 16 bytes, so loads can be 16 bytes wide
        self.routed = torch.randint(-2**31, 2**31 - 1, (experts, rows, words), dtype=torch.int32, device=DEV,
                                    generator=gen)
        swords = -(-shared_row_bytes // (4 * WORD)) * 4
        self.shared = torch.randint(-2**31, 2**31 - 1, (max(shared_rows, 1), swords), dtype=torch.int32,
                                    device=DEV, generator=gen)
        self.shared_rows = shared_rows

    def bytes(self, slots: int) -> int:
        return (slots * self.routed[0].numel() + self.shared_rows * self.shared.shape[1]) * WORD

    def reference(self, ids: torch.Tensor, n_slots: int) -> int:
        """The int32 (wrapping) sum of every word a launch reads."""
        total = sum(int(self.routed[int(e)].long().sum()) for e in ids.flatten()[:n_slots].tolist())
        if self.shared_rows:
            total += int(self.shared.long().sum())
        return (total + 2**31) % 2**32 - 2**31

    def launcher(self, kind: str, cfg: dict, n_slots: int, pdl: bool):
        """A function ids -> output of one launch of this phase's stream kernel."""
        e, rows, words = self.routed.shape
        srows, swords = self.shared_rows, self.shared.shape[1]
        if kind == "rows":
            per_slot = triton.cdiv(rows, cfg["BLOCK_R"])
            grid = n_slots * per_slot + triton.cdiv(srows, cfg["BLOCK_R"])
            out = torch.empty(grid * cfg["BLOCK_R"], dtype=torch.int32, device=DEV)

            def launch(ids):
                stream_rows_kernel[(grid,)](self.routed, self.shared, ids, out, rows * words, n_slots, per_slot,
                                            rows, words, srows, swords, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"],
                                            STAGES=cfg["STAGES"], PDL=pdl, num_warps=cfg["warps"], launch_pdl=pdl)
                return out
        else:
            # chunks sized so that the grid is about `waves` programs an SM
            sms = _sm_count()
            total = n_slots * rows * words + srows * swords
            chunk = max(cfg["BLOCK"], triton.cdiv(total, cfg["waves"] * sms) // cfg["BLOCK"] * cfg["BLOCK"])
            per_slot = triton.cdiv(rows * words, chunk)
            grid = n_slots * per_slot + (triton.cdiv(srows * swords, chunk) if srows else 0)
            out = torch.empty(grid, dtype=torch.int32, device=DEV)

            def launch(ids):
                stream_flat_kernel[(grid,)](self.routed, self.shared, ids, out, rows * words, n_slots, per_slot,
                                            chunk, srows * swords, chunk, BLOCK=cfg["BLOCK"], STAGES=cfg["STAGES"],
                                            PDL=pdl, num_warps=cfg["warps"], launch_pdl=pdl)
                return out
        return launch


ROWS_CONFIGS = [dict(BLOCK_R=r, BLOCK_K=k, warps=w, STAGES=s)
                for r, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 3)) if r * k <= 16384]
FLAT_CONFIGS = [dict(BLOCK=b, warps=w, STAGES=s, waves=v)
                for b, w, s, v in itertools.product((1024, 4096), (4, 8), (1, 3), (1, 2, 4))]


def row_bytes(k: int, fmt: str) -> int:
    """Bytes of one routed expert row of k weights: MXFP4 codes and E8M0 scales, or bf16."""
    return k // 2 + k // 32 if fmt == "mxfp4" else 2 * k


def phases_of(cfg, fmt: str) -> dict[str, Phase]:
    """The layer's phases as the timed layer holds them: routed experts in `fmt`, the shared
    expert in bf16, the router in fp32."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    ish = cfg.shared_intermediate_size
    return {"gate_up": Phase("gate_up", e, 2 * i, row_bytes(h, fmt), 2 * ish, 2 * h),
            "down": Phase("down", e, h, row_bytes(i, fmt), h if ish else 0, 2 * ish),
            "router": Phase("router", 1, 1, 4, e, 4 * h)}  # the fp32 router as a dense read


def routed_ids(block, cfg, xs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [route_triton(x, block.gate.weight, block.gate.e_score_correction_bias, cfg)[2] for x in xs]


def sweep(phase: Phase, ids: list[torch.Tensor], n_slots: int, bw: float, rows_out: list, tag: str,
          only: dict | None = None):
    """Every stream config of one phase alone (or `only` {layout: (config, us)}, another case's
    winners): checked, then timed; returns the best per layout."""
    best = {}
    want, nbytes = phase.reference(ids[0], n_slots), phase.bytes(n_slots)
    for kind, configs in (("rows", ROWS_CONFIGS), ("flat", FLAT_CONFIGS)):
        for c in (configs if only is None else [only[kind][0]]):
            launch = phase.launcher(kind, c, n_slots, pdl=False)
            try:
                got = (int(launch(ids[0]).long().sum()) + 2**31) % 2**32 - 2**31
                if got != want:
                    log(f"WRONG {tag} {phase.name} {kind} {c}: {got} != {want}")
                    continue
                us = graph_us([lambda i=i: launch(i) for i in ids], warmup=5, rep=30)
            except Exception as ex:  # a config the compiler rejects (resources) is skipped, said so
                log(f"skip {tag} {phase.name} {kind} {c}: {type(ex).__name__}: {str(ex)[:120]}")
                continue
            rows_out.append(dict(kind="stream", case=tag, phase=phase.name, layout=kind, config=c, us=us,
                                 bytes=nbytes, tb_s=nbytes / us / 1e6))
            if kind not in best or us < best[kind][1]:
                best[kind] = (c, us)
        if kind not in best:
            raise RuntimeError(f"{tag} {phase.name}: no {kind} config ran correctly (see the lines above)")
        c, us = best[kind]
        log(f"{tag:28s} {phase.name:8s} {kind:4s} best {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s "
            f"({nbytes / us / 1e6 / (bw / 1e12):5.1%} of copy)  {c}")
    return best


def parse_formats(value: str) -> list[str]:
    formats = [v for v in value.split(",") if v]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise argparse.ArgumentTypeError(f"unknown or no expert formats {unknown}; known: {', '.join(FORMATS)}")
    return formats


def parse_ms(value: str) -> list[int]:
    try:
        ms = [int(v) for v in value.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token counts must be integers, got {value!r}") from None
    if not ms or any(not 1 <= m <= 16 for m in ms):
        raise argparse.ArgumentTypeError(f"token counts must be 1 to 16 (the decode kernels' range), got {value!r}")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="ling-3.0-flash,ling-flash-2.0")
    ap.add_argument("--ms", default="1,4", type=parse_ms, help="token counts, comma-separated (default: %(default)s)")
    ap.add_argument("--formats", default="mxfp4", type=parse_formats,
                    help="routed expert formats, comma-separated (mxfp4, bf16; default: %(default)s)")
    ap.add_argument("--skip-big-read", action="store_true", help="skip the 256 MiB read-bandwidth probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows_out, summary = [dict(kind="copy_bandwidth", bytes_per_s=bw)], []

    # read-only streaming of a large buffer: this kernel's own ceiling, beside the copy's
    big = Phase("big", 1, 1, 4, 2**14, 2**14)  # 256 MiB dense
    no_ids = torch.zeros(1, dtype=torch.int32, device=DEV)  # for launches with no routed slots (never read)
    for c in FLAT_CONFIGS:
        if c["waves"] != 4 or args.skip_big_read:
            continue
        launch = big.launcher("flat", c, 0, pdl=False)
        us = graph_us([lambda: launch(no_ids)] * CALLS_PER_GRAPH, warmup=5, rep=50)
        log(f"256 MiB read, flat {c}: {us:8.1f} us, {big.bytes(0) / us / 1e6:5.2f} TB/s")
    del big

    for shape, fmt in itertools.product(args.shapes.split(","), args.formats):
        cfg = get_config(shape)
        block = build_block(cfg, fmt, seed=0)
        phases = phases_of(cfg, fmt)
        winners = {}
        for m in args.ms:
            tag = f"{shape} {fmt} M={m}"
            xs = inputs(cfg, m)
            ids = routed_ids(block, cfg, xs)
            n_slots = m * cfg.top_k
            # the configs are swept at the first M; later ones time its winners (the router's bytes
            # do not depend on M: timed once)
            best = {name: sweep(p, ids, n_slots, bw, rows_out, tag, winners.get(name))
                    for name, p in phases.items() if name != "router"}
            best["router"] = winners.get("router") or sweep(phases["router"], [no_ids] * len(ids), 0, bw, rows_out, tag)
            winners = winners or best
            with torch.no_grad():
                ours = graph_us([lambda x=x: layer_call(block, cfg, x) for x in xs])
                routing = graph_us([lambda x=x: route_triton(x, block.gate.weight, block.gate.e_score_correction_bias,
                                                             cfg) for x in xs])
            floor = sum(p.bytes(n_slots if n != "router" else 0) for n, p in phases.items()) / bw * 1e6
            line = dict(case=tag, ours_us=ours, routing_us=routing, floor_us=floor)
            for pdl in (False, True):
                for kind in ("rows", "flat"):
                    gu = phases["gate_up"].launcher(kind, best["gate_up"][kind][0], n_slots, pdl)
                    dn = phases["down"].launcher(kind, best["down"][kind][0], n_slots, pdl)

                    def chain(x, gu=gu, dn=dn, pdl=pdl):
                        _, _, i = route_triton(x, block.gate.weight, block.gate.e_score_correction_bias, cfg, pdl=pdl)
                        gu(i)
                        return dn(i)
                    with torch.no_grad():
                        line[f"chain_{kind}{'_pdl' if pdl else ''}_us"] = graph_us([lambda x=x: chain(x) for x in xs])
            for name in ("gate_up", "down", "router"):
                line[f"{name}_rows_us"] = best[name]["rows"][1]
                line[f"{name}_flat_us"] = best[name]["flat"][1]
            summary.append(line)
            rows_out.append(dict(kind="summary", **line))
            log(json.dumps(line))

    log("\n== summary (us; chain = real routing + stream-only gate_up and down: a ceiling for the layer)")
    log(f"{'case':28s} {'floor':>6s} {'ours':>6s} {'routing':>7s} {'gate_up':>7s} {'down':>6s} {'router':>6s} "
        f"{'chain':>6s} {'chain+PDL':>9s}")
    for s in summary:
        gu = min(s["gate_up_rows_us"], s["gate_up_flat_us"])
        dn = min(s["down_rows_us"], s["down_flat_us"])
        rt = min(s["router_rows_us"], s["router_flat_us"])
        ch = min(s["chain_rows_us"], s["chain_flat_us"])
        chp = min(s["chain_rows_pdl_us"], s["chain_flat_pdl_us"])
        log(f"{s['case']:28s} {s['floor_us']:6.1f} {s['ours_us']:6.1f} {s['routing_us']:7.1f} {gu:7.1f} {dn:6.1f} "
            f"{rt:6.1f} {ch:6.1f} {chp:9.1f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_stream.json").write_text(json.dumps(rows_out, indent=1, default=str))


if __name__ == "__main__":
    main()
