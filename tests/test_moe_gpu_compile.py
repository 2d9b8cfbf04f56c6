"""The MoE and routing kernels compiled for the H200 (sm_90) on any machine: Triton's NVIDIA
backend and ptxas ship in its wheel, so no GPU is needed to find out what the GPU compiler
rejects while the interpreter accepts it (a value whose shape changes across loops, an op the
interpreter emulates but sm_90 lacks). Kernels compiled for programmatic dependent launch are
also checked to write nothing to global memory before they wait (`writes_before_wait`, with a
planted kernel as its negative control): the CPU cannot run PDL, so this is where a premature
write would be caught. And the K loops of the register paths that were written to stay inside
each thread (dp4a, plain weights) are checked to hold no barrier in the compiled code
(`loop_barriers`, with a planted kernel too): a layout conversion through shared memory per K
step, which a changed load shape or Triton version can bring back, cost these loops a third of
their instructions and stalled every warp of the program twice a step. The interpreter cannot be
on for this, so the kernels are compiled in a child process with TRITON_INTERPRET=0. One tile
per product variant; the local Triton may be newer than the GPU's, so a pass here is necessary,
not sufficient (the H200's 3.6.0 gave the same verdicts on this session's kernels).

Run directly (`python tests/test_moe_gpu_compile.py [all]`) it compiles the cases and prints one
line per kernel; `all` adds more tiles.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (MXFP4, GEMV rows, word32 level, scaled): every product the launch configs can select.
VARIANTS = [(True, 0, 0, False), (True, 0, 0, True), (True, 1, 0, False), (True, 4, 1, False), (True, 4, 2, False),
            (True, 1, 3, False), (True, 4, 3, False), (False, 0, 0, False), (False, 4, 0, False)]
TILES = [(32, 128)]
MORE_TILES = [(16, 512), (64, 256), (16, 32)]


_LABEL = re.compile(r"^(\$\w+):")
_BRANCH = re.compile(r"^(@!?%p\w*\s+)?bra(\.uni)?\s+(\$\w+);")
_GLOBAL_WRITE = re.compile(r"^(@!?%p\w*\s+)?(st\.global|atom\.global|red\.global)")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)")
_SASS_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def writes_before_wait(ptx: str) -> list[str]:
    """The global stores and atomics in `ptx` that some path from the kernel's entry reaches
    before any `griddepcontrol.wait` (impl/moe/triton_pdl.py: before its wait a PDL program writes
    nothing). A must-analysis over the PTX's basic blocks: a block starts waited only if every
    predecessor ends waited."""
    body = ptx[ptx.index("{", ptx.index(".entry")) + 1:]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("//")]
    blocks, labels = [[]], {}
    for ln in lines:  # split at labels and after branches
        m = _LABEL.match(ln)
        if m:
            if blocks[-1]:
                blocks.append([])
            labels[m.group(1)] = len(blocks) - 1
            continue
        blocks[-1].append(ln)
        if _BRANCH.match(ln) or ln.startswith(("ret;", "exit;")):
            blocks.append([])
    succ = []
    for i, blk in enumerate(blocks):
        last = blk[-1] if blk else ""
        m = _BRANCH.match(last)
        out = [labels[m.group(3)]] if m and m.group(3) in labels else []
        unconditional = (m and not m.group(1)) or last.startswith(("ret;", "exit;"))
        if not unconditional and i + 1 < len(blocks):
            out.append(i + 1)
        succ.append(out)
    waited_in = [True] * len(blocks)  # optimistic start, then lowered to the fixed point
    waited_in[0] = False
    changed = True
    while changed:
        changed = False
        for i, blk in enumerate(blocks):
            w = waited_in[i] or any("griddepcontrol.wait" in ln for ln in blk)
            for j in succ[i]:
                if waited_in[j] and not w and j != 0:
                    waited_in[j] = False
                    changed = True
    offending = []
    for i, blk in enumerate(blocks):
        w = waited_in[i]
        for ln in blk:
            w = w or "griddepcontrol.wait" in ln
            if not w and _GLOBAL_WRITE.match(ln):
                offending.append(ln)
    return offending


def loop_barriers(cubin: bytes) -> list[str]:
    """The barriers (BAR) inside the loops of a compiled kernel: every instruction between a
    backward branch's target and the branch, read from the SASS that the Triton wheel's nvdisasm
    prints for the cubin."""
    import tempfile

    import triton
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, instrs, pending = {}, [], []
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line):
            pending.append(m.group(1))
        elif m := _SASS_INSTR.match(line):
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            instrs.append((addr, m.group(2)))
    found = []
    for addr, text in instrs:
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), addr + 1) <= addr:  # a backward branch: a loop
            start = labels[m.group(1)]
            found += [f"{a:#06x} {t.split(';')[0].strip()}" for a, t in instrs if start <= a <= addr and "BAR." in t]
    return found


def _compile_all(tiles) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT))
    from impl.moe import triton_dp4a as td
    from impl.moe import triton_moe as tm
    from impl.moe import triton_routing as tr
    assert not tm.FP32_MATH, "compile with TRITON_INTERPRET=0"
    target = GPUTarget("cuda", 90, 32)

    def compile_one(fn, consts, ptr_types, floats=(), num_warps=4):
        sig = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr")
               else "fp32" if n in floats else "i32" for n in fn.arg_names}
        # As a launch specializes them for the presets' shapes: pointers 16-byte aligned, strides
        # multiples of 16 elements.
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                   if n not in consts and (n.endswith("_ptr") or n.startswith("stride"))}
        return triton.compile(ASTSource(fn, sig, consts, aligned), target=target,
                              options=dict(num_warps=num_warps, num_stages=3))

    failures = 0

    def attempt(label, fn, consts, *args, barrier_free=False, **kwargs):
        """Compile; a PDL kernel must also write nothing before it waits (writes_before_wait), and
        a `barrier_free` one hold no barrier in its loops (loop_barriers)."""
        nonlocal failures
        try:
            compiled = compile_one(fn, consts, *args, **kwargs)
            early = writes_before_wait(compiled.asm["ptx"]) if consts.get("PDL") else []
            if early:
                raise AssertionError(f"global writes before griddepcontrol.wait: {early[:3]}")
            bars = loop_barriers(compiled.asm["cubin"]) if barrier_free else []
            if bars:
                raise AssertionError(f"barriers inside K loops: {bars[:4]}")
            print("OK  ", label, flush=True)
        except Exception as e:  # report every failing case, not just the first
            failures += 1
            print("FAIL", label, type(e).__name__, str(e)[-800:], flush=True)

    cases = [(i, v, t, 0) for i, v in enumerate(VARIANTS) for t in tiles]
    # The register loops loading a step ahead (GEMV_PIPELINE 1: `gemv_prefetch`) or in Triton's
    # software pipeline (3 stages: `gemv_stages`), masked and unmasked.
    cases += [(i, v, tiles[0], p) for i, v in enumerate(VARIANTS) if v[1] and (v[2] in (0, 3)) for p in (1, 3)]
    for i, (mx, rows, word32, scaled), (bn, bk), pipeline in cases:
        if word32 == 3 and bn < 32:  # the dp4a decode splits gate_up outputs in blocks of 32
            continue
        w_t = ("*i32" if word32 else "*u8") if mx else "*bf16"
        consts = dict(M_PAD=tm.M_PAD, BLOCK_N=bn, BLOCK_K=bk, MXFP4=mx, HAS_SHARED=True, GEMV_ROWS=rows,
                      WORD32=word32, SCALED=scaled, FP32_MATH=False, SHARED_SPLIT=4 if rows else 1,
                      SHARED_BLOCK_K=64 if rows else bk, EVEN=i % 2 == 0,  # masked and unmasked loads
                      GEMV_PIPELINE=pipeline,
                      PDL=word32 != 2)  # (launched without PDL, the kernels compile as they did before it)
        # Register paths whose loops stay inside each thread: dp4a, and plain weights (the
        # shared expert of every register path is plain, so with one row all its loops are).
        # (Triton's software pipeline waits for its copies at a barrier a step: only without it.)
        barrier_free = rows > 0 and (word32 == 3 or not mx) and pipeline < 2
        down_consts = dict(consts, PREFETCH=consts["PDL"] and rows > 0)
        label = (f"mxfp4={mx} gemv_rows={rows} word32={word32} scaled={scaled} tiles={bn}x{bk} pdl={consts['PDL']} "
                 f"even={consts['EVEN']} gemv_pipeline={pipeline}")
        attempt(f"moe_gate_up_kernel {label}", tm.moe_gate_up_kernel, consts,
                dict(slot_expert_ptr="*i32", slot_tokens_ptr="*i32", w_ptr=w_t, ws_ptr="*u8", xq_ptr="*i32",
                     xs_ptr="*fp32", act_ptr="*i32" if word32 == 3 else "*bf16", act_s_ptr="*fp32"),
                barrier_free=barrier_free)
        attempt(f"moe_down_kernel {label} prefetch={down_consts['PREFETCH']}", tm.moe_down_kernel, down_consts,
                dict(slot_expert_ptr="*i32", slot_weight_ptr="*fp32", slot_tokens_ptr="*i32", w_ptr=w_t,
                     ws_ptr="*u8", partial_ptr="*fp32", counter_ptr="*i32",
                     act_ptr="*i32" if word32 == 3 else "*bf16", act_s_ptr="*fp32"),
                barrier_free=barrier_free)
    attempt("split_int8_kernel", td.split_int8_kernel, dict(BLOCK_K=512), dict(q_ptr="*i32", s_ptr="*fp32"))
    routing_ptrs = dict(counter_ptr="*i32", ids_ptr="*i32", slot_expert_ptr="*i32", slot_weight_ptr="*fp32",
                        slot_tokens_ptr="*i32", weights_ptr="*fp32", logits_ptr="*fp32", bias_ptr="*fp32",
                        w_ptr="*fp32", x_ptr="*bf16", xq_ptr="*i32", xs_ptr="*fp32")
    meta = dict(ROUTER=1, RENORMALIZE=True, HAS_BIAS=True, N_GROUP=8, TOPK_GROUP=4, ROWS=1, M_PAD=tm.M_PAD,
                E_PAD=512, K_PAD=8, S_PAD=8, PDL=True)
    attempt("router_topk_kernel 1 warp", tr.router_topk_kernel, meta, routing_ptrs, ("routed_scaling",), 1)
    attempt("router_topk_kernel softmax 4 rows", tr.router_topk_kernel,
            dict(meta, ROUTER=0, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1, ROWS=4), routing_ptrs, ("routed_scaling",))
    for split_x in (False, True):
        attempt(f"router_logits_kernel 4 rows split_x={split_x} pdl={split_x}", tr.router_logits_kernel,
                dict(ROWS=4, BLOCK_E=2, BLOCK_K=4096, SPLIT_X=split_x, PDL=split_x, PREFETCH=split_x), routing_ptrs)
        attempt(f"router_fused_kernel split_x={split_x} pdl={not split_x}", tr.router_fused_kernel,
                dict(meta, BLOCK_E=4, BLOCK_K=1024, SPLIT_X=split_x, PDL=not split_x, PREFETCH=not split_x), routing_ptrs,
                ("routed_scaling",))
    # Negative controls of the static checks: each flags its planted defect, and only that.
    sys.path.insert(0, str(ROOT / "tests"))
    import planted_kernels as pk
    for fn, planted in ((pk.writes_after_waiting, False), (pk.writes_before_waiting, True)):
        early = writes_before_wait(compile_one(fn, dict(PDL=True), dict(out_ptr="*fp32")).asm["ptx"])
        ok = bool(early) == planted
        failures += not ok
        print("OK  " if ok else "FAIL", f"PDL check on {fn.__name__}: flagged {early}", flush=True)
    for fn, planted in ((pk.reduces_after_the_loop, False), (pk.reduces_every_step, True)):
        bars = loop_barriers(compile_one(fn, {}, dict(w_ptr="*fp32", out_ptr="*fp32")).asm["cubin"])
        ok = bool(bars) == planted
        failures += not ok
        print("OK  " if ok else "FAIL", f"loop barrier check on {fn.__name__}: flagged {bars}", flush=True)
    print("failures:", failures)
    return failures


def test_kernels_compile_for_sm90():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if "ptxas" in out and ("not found" in out or "No such file" in out):
        pytest.skip(f"no ptxas for this Triton: {out[-300:]}")
    assert proc.returncode == 0 and "failures: 0" in proc.stdout, out[-4000:]


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(1 if _compile_all(TILES + (MORE_TILES if sys.argv[1:] == ["all"] else [])) else 0)
