#!/usr/bin/env python3
"""One batch-1 decode step (one token) of each Ling 3.0 attention layer kind at Ling-3.0-flash
shapes, timed on a CUDA GPU against its byte floor, at contexts L (default 1k, 8k, 32k).

Random weights (normal * 0.02 in bf16, norm weights 1; KDA's A_log, dt_bias, conv1d weight fp32):
  kda step      KDAAttention(2560, 32 heads of 128, conv kernel 4): the recurrent step on a random fp32
                state, input_pos [L] (0 would reset it). Independent of L; still run at every L.
                With the projections fused (as build_model leaves it), the token goes through
                impl.model.kda_decode's one kernel.
  kda step-torch  the same step through the torch ops (the kernel's peer, same process).
  kda proj      its fused q|k|v|f|g|b GEMV and o_proj alone on the same x (projections vs state update).
  mla absorbed  MLAAttention (r 512, rope 64, nope 128, v 128), the default one-token form, on a cache
                of S = L + 16 rows (rows 0..L-1 random), mask True for positions 0..L.
                On CUDA: impl.model.mla_absorb's query kernel, impl.model.mla_decode's split-K
                attention over rows 0..L and its combine, mla_absorb's output kernel.
  mla absorbed-torch  the same call through SDPA over the masked cache (the kernel's peer).
  mla expanded  the same call with absorb=False (every cached latent up-projected).
  mla proj      its q_proj, kv_a_proj, g_proj and o_proj GEMVs alone.
  parts         the pieces of each step alone, to say where a step's time goes: every
                GEMV through cuBLAS (bf16);
                impl.model.kda_decode's kernel alone; impl.model.mla_decode's attention alone over
                the L + 1 valid rows from the token's position (as the model calls it), at each
                launch config of MLA_CONFIGS (the first is the committed default).
Each call is captured alone in a CUDA graph and timed as the median replay under
`triton.testing.do_bench` (which flushes L2 first, so weights come from HBM as in decode).

Byte floor: every parameter once (bf16 2 B, fp32 4 B); KDA adds the recurrent [32,128,128] and conv
[12288,3] fp32 states, each read and written; MLA adds the S cache rows of 576 bf16 read (SDPA reads
the whole cache, masked) and one row written (`bytes_attended`: the L + 1 attended rows instead).
floor_us = bytes / bandwidth, at the H200 nominal 4.8 TB/s and at the bandwidth measured here (the
better of a 2 GiB bf16 sum and a 4 GiB device copy); fraction = floor_us / measured_us.

Run from the repository root on the GPU machine with the repository root on PYTHONPATH:
    python3 scripts/gpu/bench_attention.py --out $OUT            # under a minute on an H200
    python3 scripts/gpu/bench_attention.py --kinds mla --contexts 1024,131072
Prints a table last; writes DIR/attention_bench.json with --out DIR (default $OUT). Exit status 0;
1 when a case failed (the others still run); 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

from impl.gpu_timing import copy_bandwidth, graph_us
from impl.model.kda import KDAAttention
from impl.model.mla import MLAAttention, MLAConfig, mla_rope_tables
from impl.model.mla_decode import DEFAULT_CONFIG, MLADecodeConfig, mla_decode_attention
from pytest_moeperf.baselines import atomic_write_text

NOMINAL_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
FLASH_KDA = dict(hidden_size=2560, num_heads=32, head_dim=128, conv_kernel_size=4)
FLASH_MLA = MLAConfig(hidden_size=2560, num_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128)
KDA_FP32_PARAMS = ("forget_gate.A_log", "forget_gate.dt_bias", "conv1d.weight")
KDA_PROJ = ("q_proj", "k_proj", "v_proj", "g_proj", "forget_gate.f_proj", "b_proj", "o_proj")
MLA_CACHE_SLACK = 16  # S = L + 16
DEVICE = torch.device("cuda", 0)
# The attention kernel's sweep (splits, min_chunk_rows, block_rows, num_warps, num_stages, combine_block_r),
# timed as the model calls it (from positions). Triton's two-stage pipeline issues the next tile's
# copy after the step's products and waits for it at the next step's start, so one program an SM
# overlaps no load with a product (64-row tiles in two stages: 184 KB of shared memory, one program
# an SM; 132 = the H200's SMs); 32-row tiles in three or four stages keep copies in flight (mma.sync,
# not wgmma). Longer minimum chunks and fewer splits write fewer partial results.
MLA_CONFIGS = [DEFAULT_CONFIG] + [MLADecodeConfig(*c) for c in (
    (132, 64, 64, 4, 2, 32), (132, 128, 64, 4, 2, 32), (132, 64, 64, 4, 2, 64), (132, 64, 64, 8, 2, 32),
    (66, 64, 64, 4, 2, 32), (132, 64, 32, 4, 3, 32), (132, 64, 32, 4, 4, 32))]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# -- modules and byte floors (CPU / meta friendly) ---------------------------------------------
def build_kda(device="meta", dtype=torch.bfloat16) -> KDAAttention:
    """KDA at Ling-3.0-flash shapes, in `dtype` except the parameters the checkpoint keeps in fp32."""
    with torch.device(device):
        m = KDAAttention(**FLASH_KDA).to(dtype)
    for name, p in m.named_parameters():
        if name in KDA_FP32_PARAMS:
            p.data = p.data.to(torch.float32)
    return m.requires_grad_(False)


def build_mla(device="meta", dtype=torch.bfloat16) -> MLAAttention:
    with torch.device(device):
        return MLAAttention(FLASH_MLA).to(dtype).requires_grad_(False)


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def kda_proj_bytes(m: KDAAttention) -> int:
    return sum(param_bytes(m.get_submodule(n)) for n in KDA_PROJ)


def kda_state_bytes(m: KDAAttention, batch: int = 1) -> int:
    """Recurrent state and conv state (fp32), each read once and written once by a step."""
    recurrent = batch * m.num_heads * m.head_dim * m.head_dim * 4
    conv = batch * m.conv_dim * (m.conv_kernel_size - 1) * 4
    return 2 * (recurrent + conv)


def mla_cache_bytes(cfg: MLAConfig, rows_read: int, elem_bytes: int = 2) -> int:
    """`rows_read` cache rows read plus the new token's row written."""
    return (rows_read + 1) * cfg.cache_dim * elem_bytes


def floor_us(nbytes: int, bytes_per_s: float) -> float:
    return nbytes / bytes_per_s * 1e6


# -- GPU measurement ---------------------------------------------------------------------------
def log(*a, **kw) -> None:
    print(*a, **kw, flush=True)


def randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)


def read_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second read by a bf16 `.sum()` of `nbytes` (median)."""
    import triton.testing
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    ms = triton.testing.do_bench(lambda: t.sum(dtype=torch.float32), warmup=50, rep=300, return_mode="median")
    del t
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def step_us(fn, rep_ms: int) -> float:
    """Median us of one call of `fn`, captured alone in a CUDA graph."""
    with torch.inference_mode():
        return graph_us([fn], warmup=25, rep=rep_ms)


def kda_cases(ctx: int, dtype, gen, dev):
    m = build_kda(dev, dtype)
    randomize_(m, gen)
    m.fuse_projections()  # as build_model leaves it: q|k|v|f|g|b in one GEMV
    state = m.setup_cache(1, device=dev)
    state.recurrent.normal_(0.0, 0.01, generator=gen)
    state.conv.normal_(0.0, 1.0, generator=gen)
    x = torch.randn(1, 1, m.hidden_size, device=dev, generator=gen).to(dtype)
    o_in = torch.randn(1, 1, m.qkv_dim, device=dev, generator=gen).to(dtype)
    pos = torch.tensor([ctx], device=dev)

    def proj_only():
        m._projections(x[:, 0])
        m.o_proj(o_in)

    def torch_step():  # the same step through the torch attention backend
        return m.forward_torch(x, None, None, pos, None)

    with torch.inference_mode():
        ok = bool(torch.isfinite(m(x, None, None, pos, None)).all())
    weights, state_bytes = param_bytes(m), kda_state_bytes(m)
    yield dict(form="step", S=None, weight_bytes=weights, state_bytes=state_bytes, bytes=weights + state_bytes,
               finite=ok), lambda: m(x, None, None, pos, None)
    yield dict(form="step-torch", S=None, weight_bytes=weights, state_bytes=state_bytes,
               bytes=weights + state_bytes), torch_step
    pb = kda_proj_bytes(m)
    yield dict(form="proj", S=None, weight_bytes=pb, state_bytes=0, bytes=pb), proj_only


def mla_cases(ctx: int, dtype, gen, dev):
    m = build_mla(dev, dtype)
    randomize_(m, gen)
    m.fuse_projections()  # as build_model leaves it: q|kv_a|g in one GEMV
    s = ctx + MLA_CACHE_SLACK
    cache = m.setup_cache(1, s, dtype, dev)
    cache.kv[:, :ctx].normal_(generator=gen)
    cos, sin = (t[ctx:ctx + 1] for t in mla_rope_tables(FLASH_MLA, s, device=dev))
    mask = torch.zeros(1, s, dtype=torch.bool, device=dev)
    mask[0, :ctx + 1] = True  # the L cached rows and the new token's (row L, written by the call)
    x = torch.randn(1, 1, FLASH_MLA.hidden_size, device=dev, generator=gen).to(dtype)
    pos = torch.tensor([ctx], device=dev)
    with torch.inference_mode():
        a, e = m(x, cos, sin, pos, mask), m(x, cos, sin, pos, mask, absorb=False)
        rel = ((a.double() - e.double()).norm() / e.double().norm()).item()
    weights, elem = param_bytes(m), cache.kv.element_size()
    base = dict(S=s, weight_bytes=weights, cache_bytes=mla_cache_bytes(FLASH_MLA, s, elem),
                bytes_attended=weights + mla_cache_bytes(FLASH_MLA, ctx + 1, elem), absorbed_vs_expanded_rel=rel)
    base["bytes"] = weights + base["cache_bytes"]
    for form, absorb in (("absorbed", None), ("expanded", False)):
        fn = lambda absorb=absorb: m(x, cos, sin, pos, mask, absorb=absorb)  # noqa: E731
        yield dict(base, form=form, fused_sdpa=fused_sdpa_ok(fn)), fn

    def absorbed_torch():  # the kernel's peer: the absorbed form through SDPA over the masked cache
        return m.forward_torch(x, cos, sin, pos, mask)
    yield dict(base, form="absorbed-torch"), absorbed_torch
    o_in = torch.randn(1, 1, FLASH_MLA.num_heads * FLASH_MLA.v_head_dim, device=dev, generator=gen).to(dtype)

    def proj_only():  # the layer's GEMVs alone: what is left is attention and glue
        m._projections(x)
        m.o_proj(o_in)
    pb = sum(param_bytes(getattr(m, n)) for n in ("q_proj", "kv_a_proj_with_mqa", "g_proj", "o_proj"))
    yield dict(base, form="proj", weight_bytes=pb, cache_bytes=0, bytes=pb), proj_only


def gemv_rows(kind: str, gemvs: dict[str, torch.Tensor], x_for):
    """Each weight [N, K] of `gemvs` as a batch-1 GEMV through cuBLAS (bf16)."""
    import torch.nn.functional as F
    for name, w in gemvs.items():
        x = x_for(w.shape[1])
        nbytes = w.numel() * w.element_size()
        yield dict(kind=kind, form=f"{name} cublas", S=None, weight_bytes=nbytes, bytes=nbytes), \
            (lambda w=w, x=x: F.linear(x, w))


def part_cases(ctx: int, dtype, gen, dev):
    from impl.model.kda_decode import kda_decode
    x_for = lambda k: torch.randn(1, k, device=dev, generator=gen).to(dtype)  # noqa: E731
    kda = build_kda(dev, dtype)
    randomize_(kda, gen)
    kda.fuse_projections()
    if ctx == 1024:  # the GEMVs and the KDA kernel do not depend on the context
        yield from gemv_rows("kda", {"in_proj": kda.in_proj, "o_proj": kda.o_proj.weight}, x_for)
        state = kda.setup_cache(1, device=dev)
        state.recurrent.normal_(0.0, 0.01, generator=gen)
        hd = kda.qkv_dim
        proj = torch.randn(1, kda.in_proj.shape[0], device=dev, generator=gen).to(dtype)
        keep = torch.ones(1, device=dev)

        def kernel():
            kda_decode(proj[:, :3 * hd], proj[:, 3 * hd:4 * hd], proj[:, 5 * hd:], proj[:, 4 * hd:5 * hd], state.conv,
                       kda.conv1d.weight.view(kda.conv_dim, kda.conv_kernel_size), kda.forget_gate.dt_bias,
                       kda.forget_gate.A_log, kda.o_norm.weight, state.recurrent, state.recurrent, keep,
                       kda.num_heads, kda.forget_gate.safe_gate, kda.forget_gate.lower_bound, kda.o_norm.eps)
        sb = kda_state_bytes(kda)
        yield dict(kind="kda", form="kernel", S=None, weight_bytes=0, state_bytes=sb, bytes=sb), kernel
        mla = build_mla(dev, dtype)
        randomize_(mla, gen)
        mla.fuse_projections()
        yield from gemv_rows("mla", {"in_proj": mla.in_proj}, x_for)
    c = FLASH_MLA
    kv = torch.randn(1, ctx + MLA_CACHE_SLACK, c.cache_dim, device=dev, generator=gen).to(dtype)
    query = torch.randn(1, c.num_heads, c.cache_dim, device=dev, generator=gen).to(dtype)
    position = torch.tensor([ctx], device=dev)  # row ctx is the token's own, written by the launch before
    nbytes = mla_cache_bytes(c, ctx, kv.element_size())  # the L + 1 valid rows, read only
    for cfg in MLA_CONFIGS:
        tag = (f"attn {cfg.splits}/{cfg.min_chunk_rows}/{cfg.block_rows}/{cfg.num_warps}w/{cfg.num_stages}s/"
               f"c{cfg.combine_block_r}")
        yield dict(kind="mla", form=tag, S=ctx + MLA_CACHE_SLACK, weight_bytes=0, bytes=nbytes, config=cfg.__dict__), \
            (lambda cfg=cfg: mla_decode_attention(query, kv, None, c.kv_lora_rank, c.scaling, config=cfg,
                                                  positions=position))


def fused_sdpa_ok(fn) -> bool:
    """Whether `fn` runs with SDPA's math backend disallowed (False: it falls back to math, which for
    the absorbed form's single shared key head repeats the cache for every head)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with torch.inference_mode(), warnings.catch_warnings(), sdpa_kernel(fused):
            warnings.simplefilter("ignore")
            fn()
        return True
    except RuntimeError:
        return False


def timed_row(row: dict, fn, measured_bps: float, rep_ms: int, errors: list) -> dict:
    """`row` with the measured time and the floors and fractions at both bandwidths (or the error)."""
    try:
        us = step_us(fn, rep_ms)
    except Exception as ex:  # noqa: BLE001
        row["error"] = repr(ex)
        errors.append(f"{row['kind']} {row['form']} L={row['L']}: {ex!r}")
        traceback.print_exc(limit=3)
        return row
    nom_us, meas_us = floor_us(row["bytes"], NOMINAL_BYTES_PER_S), floor_us(row["bytes"], measured_bps)
    row.update(measured_us=us, floor_us_nominal=nom_us, floor_us_measured=meas_us,
               fraction_nominal=nom_us / us, fraction_measured=meas_us / us)
    log(f"  {row['kind']} {row['form']:26s} L={row['L']:6d} {us:8.1f} us  {100 * nom_us / us:5.1f}% of nominal floor")
    return row


CASES = {"kda": kda_cases, "mla": mla_cases, "parts": part_cases}


def best_attention_config(rows: list[dict]) -> tuple[MLADecodeConfig, list[float]] | None:
    """The swept attention config with the least time summed over the contexts (timed at all of
    them), and its times."""
    totals: dict[str, list] = {}
    for r in rows:
        if r.get("config") and "measured_us" in r:
            totals.setdefault(r["form"], (MLADecodeConfig(**r["config"]), []))[1].append(r["measured_us"])
    full = max((len(t[1]) for t in totals.values()), default=0)
    timed = [t for t in totals.values() if len(t[1]) == full]
    return min(timed, key=lambda t: sum(t[1])) if timed else None


def adopt_best_attention(rows: list[dict], device: str, contexts: list[int]) -> None:
    """The best swept config into impl/model/mla_decode.py's table (and its JSON file), for the layers timed next."""
    from impl.model import mla_decode
    if (best := best_attention_config(rows)) is not None:
        cfg, times = best
        mla_decode.TUNED[(device,)] = cfg
        measured = ("scripts/gpu/bench_attention.py --adopt-best, the kernel alone: "
                    + " / ".join(f"{t:.1f}" for t in times) + " us at " + " / ".join(map(str, contexts)) + " rows")
        mla_decode.TABLE.save({(device,): cfg}, measured)
        log(f"adopted: TUNED[{(device,)!r}] = {cfg!r} ({measured})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,32768", help="context lengths L, comma-separated")
    ap.add_argument("--kinds", default="parts,kda,mla", help="comma-separated, of kda, mla, parts")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for attention_bench.json ($OUT)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench rep per timed call, ms")
    ap.add_argument("--adopt-best", action="store_true",
                    help="after `parts`, run the layers with the attention config of the least summed time over "
                         "the contexts, and write it as this device's entry of impl/model/mla_decode_tuned.json")
    args = ap.parse_args(argv)
    contexts = [int(v) for v in args.contexts.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",")]
    if bad := set(kinds) - set(CASES):
        ap.error(f"unknown kinds {sorted(bad)}")
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA device (none is available)", file=sys.stderr)
        sys.exit(2)

    import triton
    dev, dtype = DEVICE, DTYPES[args.dtype]
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "dtype": args.dtype}
    log("device:", json.dumps(info))
    read_bps, copy_bps = read_bandwidth(), copy_bandwidth()
    measured_bps = max(read_bps, copy_bps)
    log(f"read (bf16 sum) {read_bps / 1e12:.3f} TB/s, copy {copy_bps / 1e12:.3f} TB/s (read + written); "
        f"floor at {measured_bps / 1e12:.3f} TB/s and at nominal {NOMINAL_BYTES_PER_S / 1e12:.1f} TB/s")

    rows, errors = [], []
    gen = torch.Generator(device=dev).manual_seed(1234)
    for kind in kinds:
        for ctx in contexts:
            try:
                for row, fn in CASES[kind](ctx, dtype, gen, dev):
                    rows.append(timed_row(dict(dict(kind=kind, L=ctx), **row), fn, measured_bps, args.rep_ms, errors))
            except Exception as ex:  # noqa: BLE001  (building the case failed)
                errors.append(f"{kind} L={ctx}: {ex!r}")
                traceback.print_exc(limit=3)
            torch.cuda.empty_cache()
        if kind == "parts" and args.adopt_best:
            adopt_best_attention(rows, info["device"], contexts)

    result = dict(info=info, nominal_bytes_per_s=NOMINAL_BYTES_PER_S, read_bytes_per_s=read_bps,
                  copy_bytes_per_s=copy_bps, measured_bytes_per_s=measured_bps, rows=rows, errors=errors)
    if args.out:
        atomic_write_text(Path(args.out) / "attention_bench.json", json.dumps(result, indent=1))

    log(f"\n== one decode step, batch 1 ({info['device']}; floor at nominal {NOMINAL_BYTES_PER_S / 1e12:.1f} "
        f"and measured {measured_bps / 1e12:.2f} TB/s)")
    log(f"{'kind':4s} {'form':26s} {'L':>6s} {'S':>6s} {'MB':>7s} {'us':>8s} {'floor us':>8s} {'nom%':>6s} "
        f"{'meas%':>6s}")
    for r in rows:
        s = f"{r['S']:6d}" if r["S"] else "     -"
        head = f"{r['kind']:4s} {r['form']:26s} {r['L']:6d} {s} {r['bytes'] / 1e6:7.2f}"
        if "measured_us" in r:
            log(f"{head} {r['measured_us']:8.1f} {r['floor_us_nominal']:8.1f} {100 * r['fraction_nominal']:5.1f}% "
                f"{100 * r['fraction_measured']:5.1f}%")
        else:
            log(f"{head}   FAILED {r['error'][:80]}")
    for r in rows:
        if r["kind"] == "mla" and r["form"] == "absorbed":
            log(f"mla L={r['L']}: absorbed vs expanded output rel err {r['absorbed_vs_expanded_rel']:.2e}")
        if r["kind"] == "mla" and not r.get("fused_sdpa", True):
            log(f"mla {r['form']} L={r['L']}: SDPA falls back to its math backend")
    if errors:
        log("errors:", *errors, sep="\n  ")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
