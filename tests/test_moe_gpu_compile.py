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
Separately, every committed launch config's expert kernels are built as `expert_launch` would
launch them and checked not to spill registers (`resources`, a planted spilling config as the
negative control) and, in their plain-weight loops, not to copy a load into a later pass
(`loop_load_copies`, planted kernels as its negative control: such a copy waits for the load in
the pass that issued it, so loading ahead gains nothing); the same run prints each kernel's
registers, shared memory, programs an SM and waves over the H200's 132 SMs: the occupancy
picture of a config, without a GPU.

Run directly (`python tests/test_moe_gpu_compile.py [all | configs]`) it compiles the cases and
prints one line per kernel; `all` adds more tiles, `configs` checks the committed configs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (MXFP4, GEMV rows): every product path the launch configs can select (tensor cores, the register
# path: dp4a for MXFP4, plain multiply-adds for plain weights).
VARIANTS = [(True, 0), (True, 1), (True, 4), (False, 0), (False, 4)]
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


def releases_before_wait(ptx: str) -> bool:
    """Whether a PDL kernel lets the next launch start (`griddepcontrol.launch_dependents`) before
    it waits for the launch before (`griddepcontrol.wait`), in the PTX's order."""
    release, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    return 0 <= release < wait


def _sass_loops(cubin: bytes) -> list[list[tuple[int, str]]]:
    """The loops of a compiled kernel, each as its instructions (address, text) from a backward
    branch's target to the branch, read from the SASS that the Triton wheel's nvdisasm prints."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_wheel_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    labels, instrs, pending = {}, [], []
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line):
            pending.append(m.group(1))
        elif m := _SASS_INSTR.match(line):
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            instrs.append((addr, m.group(2).split(";")[0].strip()))
    loops = []
    for addr, text in instrs:
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), addr + 1) <= addr:  # a backward branch: a loop
            loops.append([(a, t) for a, t in instrs if labels[m.group(1)] <= a <= addr])
    return loops


def loop_barriers(cubin: bytes) -> list[str]:
    """The barriers (BAR) inside the loops of a compiled kernel."""
    return [f"{a:#06x} {t}" for loop in _sass_loops(cubin) for a, t in loop if "BAR." in t]


_SASS_LOAD = re.compile(r"^(?:@!?P\d+\s+)?LDG\.E(?:\.(\w+))?\S*\s+R(\d+),")
_SASS_COPY = re.compile(r"^(?:@!?P\d+\s+)?(?:MOV|IMAD\.MOV\.U32)\s+R(\d+),\s*(?:RZ,\s*RZ,\s*)?R(\d+)\b")
_SASS_DEST = re.compile(r"^(?:@!?P\d+\s+)?[A-Z][\w.]*\s+R(\d+)\b")


def _reads(text: str, reg: int) -> bool:
    """Whether an instruction reads register `reg` (an operand after its first)."""
    _, _, operands = text.partition(",")
    return re.search(rf"\bR{reg}\b", operands) is not None


def _writes(text: str) -> int | None:
    """The register an instruction writes (its first operand), if it writes one."""
    m = _SASS_DEST.match(text)
    return int(m.group(1)) if m else None


def loop_load_copies(cubin: bytes, skip=("IDP.4A",)) -> list[str]:
    """Register copies inside a loop of a compiled kernel that carry a global load issued earlier
    in the same pass into a later one (the copy's register is not read again in this pass): the
    copy waits for its load, so that load's round trip is spent inside the pass that issued it,
    whatever the source code meant to load ahead. (A copy read later in the same pass only moves
    a load to where it is used anyway.) Loops holding an instruction named in `skip` are not
    looked at (the dp4a loops, see `_check_configs`)."""
    found = []
    for loop in _sass_loops(cubin):
        if any(op in t for _, t in loop for op in skip):
            continue
        in_flight = {}  # register -> the load that writes it, this pass
        for i, (addr, text) in enumerate(loop):
            if m := _SASS_LOAD.match(text):
                width = {"128": 4, "64": 2}.get(m.group(1) or "", 1)
                in_flight.update((int(m.group(2)) + j, f"{addr:#06x} {text}") for j in range(width))
                continue
            m = _SASS_COPY.match(text)
            if m and int(m.group(2)) in in_flight:
                dest = int(m.group(1))
                later = next((t for _, t in loop[i + 1:] if _reads(t, dest) or _writes(t) == dest), None)
                if later is None or not _reads(later, dest):  # carried to the next pass
                    found.append(f"{addr:#06x} {text} copies {in_flight[int(m.group(2))]}")
            in_flight.pop(_writes(text), None)
    return found


# The gate-up kernel's fp32 scalars: its SwiGLU clipping limits.
GATE_UP_FLOATS = ("swiglu_limit", "shared_limit")


def compile_one(fn, consts, ptr_types, floats=(), num_warps=4, num_stages=3):
    """`fn` compiled for sm_90 with these constexprs; pointers typed by `ptr_types` (else bf16),
    `floats` fp32 scalars, every other argument i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n in floats else "i32" for n in fn.arg_names}
    # As a launch specializes them for the presets' shapes: pointers 16-byte aligned, strides
    # multiples of 16 elements.
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n not in consts and (n.endswith("_ptr") or n.startswith("stride"))}
    return triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _wheel_tool(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, bytes of stack and local memory a thread: where ptxas puts what the
    registers do not hold) of a compiled kernel, as the Triton wheel's cuobjdump reports them."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_wheel_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage))
    if len(fields) != 3:
        raise RuntimeError(f"unexpected cuobjdump output: {usage[-300:]}")
    return int(fields["REG"]), int(fields["STACK"]) + int(fields["LOCAL"])


# An H200 (sm_90) SM: registers, threads, programs, shared memory (bytes a program may use).
SMS = 132  # an H200's SMs (the SM's own limits: `triton_launch.resident_programs`' defaults)


def _moe_ptr_types(w_type: str, dp4a: bool) -> dict:
    """Pointer types of the expert kernels' arguments, weights as `w_type`."""
    return dict(slot_expert_ptr="*i32", slot_weight_ptr="*fp32", slot_tokens_ptr="*i32", w_ptr=w_type, ws_ptr="*u8",
                xq_ptr="*i32", xs_ptr="*fp32", partial_ptr="*fp32", counter_ptr="*i32",
                act_ptr="*i32" if dp4a else "*bf16", act_s_ptr="*fp32")


def _compile_all(tiles) -> int:
    from impl.moe import triton_dp4a as td
    from impl.moe import triton_experts as te
    from impl.moe import triton_routing as tr
    from impl.moe.moe_launch_config import M_PAD
    from impl.triton_env import FP32_MATH
    assert not FP32_MATH, "compile with TRITON_INTERPRET=0"
    failures = 0

    def attempt(label, fn, consts, *args, barrier_free=False, releases_early=None, **kwargs):
        """Compile; a PDL kernel must also write nothing before it waits (writes_before_wait), a
        `barrier_free` one hold no barrier in its loops (loop_barriers), and where
        `releases_early` is given, release the next launch before its wait exactly when it is True."""
        nonlocal failures
        try:
            compiled = compile_one(fn, consts, *args, **kwargs)
            early = writes_before_wait(compiled.asm["ptx"]) if consts.get("PDL") else []
            if early:
                raise AssertionError(f"global writes before griddepcontrol.wait: {early[:3]}")
            if releases_early is not None and releases_before_wait(compiled.asm["ptx"]) != releases_early:
                raise AssertionError(f"releases the next launch {'after' if releases_early else 'before'} its wait")
            bars = loop_barriers(compiled.asm["cubin"]) if barrier_free else []
            if bars:
                raise AssertionError(f"barriers inside K loops: {bars[:4]}")
            print("OK  ", label, flush=True)
        except Exception as e:  # report every failing case, not just the first
            failures += 1
            print("FAIL", label, type(e).__name__, str(e)[-800:], flush=True)

    cases = [(i, v, t, 0) for i, v in enumerate(VARIANTS) for t in tiles]
    # The register loops loading one or two steps ahead (AHEAD 1, 2), masked and unmasked.
    cases += [(i, v, tiles[0], ahead) for i, v in enumerate(VARIANTS) if v[1] for ahead in (1, 2)]
    for i, (mx, rows), (bn, bk), ahead in cases:
        dp4a = mx and rows > 0
        w_t = ("*i32" if dp4a else "*u8") if mx else "*bf16"
        consts = dict(M_PAD=M_PAD, BLOCK_N=bn, BLOCK_K=bk, MXFP4=mx, HAS_SHARED=True, GEMV_ROWS=rows,
                      FP32_MATH=False, SHARED_SPLIT=4 if rows else 1,
                      SHARED_BLOCK_K=64 if rows else bk, EVEN=i % 2 == 0,  # masked and unmasked loads
                      AHEAD=ahead, SHARED_AHEAD=ahead,
                      PDL=i != 0)  # (launched without PDL, the kernels compile as they did before it)
        # SwiGLU clipping (Ling 3.0's late layers) on half the cases: the gate-up kernel's epilogue.
        clip = dict(CLIP=(i + ahead) % 2 == 1)
        # The register loops stay inside each thread (dp4a, and plain weights: the shared expert
        # of every register path is plain).
        barrier_free = rows > 0
        down_consts = dict(consts, L2_PREFETCH=consts["PDL"] and rows > 0)
        label = f"mxfp4={mx} gemv_rows={rows} tiles={bn}x{bk} pdl={consts['PDL']} even={consts['EVEN']} ahead={ahead}"
        ptr_types = _moe_ptr_types(w_t, dp4a)
        attempt(f"moe_gate_up_kernel {label} clip={clip['CLIP']}", te.moe_gate_up_kernel, dict(consts, **clip), ptr_types,
                barrier_free=barrier_free, floats=GATE_UP_FLOATS)
        attempt(f"moe_down_kernel {label} l2_prefetch={down_consts['L2_PREFETCH']}", te.moe_down_kernel, down_consts,
                ptr_types, barrier_free=barrier_free)
    attempt("split_int8_kernel", td.split_int8_kernel, dict(BLOCK_K=512), dict(q_ptr="*i32", s_ptr="*fp32"))
    # The planted slowdown's stamp and spin (impl/plant.py), which only a GPU runs.
    from impl import plant
    stamp, spin = plant.kernels()
    attempt("plant_stamp_kernel", stamp, {}, dict(stamp_ptr="*i64"))
    attempt("plant_spin_kernel", spin, {}, dict(stamp_ptr="*i64"), ("fraction",))
    # The kernels before the attention layers' o_proj: KDA's output kernel lets the GEMV start
    # before it waits only when asked (a decode token; a verify pass's next token reads the state),
    # MLA's combine and output kernels always (what follows them reads only weights before its wait).
    from impl.model import kda_decode as kd
    from impl.model import mla_absorb as ma
    from impl.model import mla_decode as md
    kda_ptrs = dict(conv_state_ptr="*fp32", keep_ptr="*fp32")
    for early in (False, True):
        attempt(f"kda_output_kernel release_early={early}", kd.kda_output_kernel,
                dict(D=128, KERN=4, KP=4, PDL=True, RELEASE_EARLY=early), kda_ptrs, ("norm_eps",), releases_early=early)
    attempt("mla_combine_kernel", md.mla_combine_kernel,
            dict(R=512, BLOCK_H=32, BLOCK_R=32, BLOCK_SPLITS=256, BLOCK_ROWS=64, MIN_CHUNK=64, EARLY=True, PDL=True),
            dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", length_ptr="*i64"), releases_early=True)
    for gate in (True, False):  # Ling 3.0's gated heads; DeepSeek-V3's without a gate
        attempt(f"mla_output_kernel gate={gate}", ma.mla_output_kernel,
                dict(R=512, DV=128, BLOCK_V=32, GATE=gate, PDL=True), {}, releases_early=True)
    # The decode step's residual add + RMS norm (impl/model/add_rms_norm.py) at Ling-3.0-flash's
    # width: it too lets the launch after it (a GEMV, the router: weights only before their wait) start first.
    from impl.model import add_rms_norm as arn
    attempt("add_rms_norm_kernel", arn.add_rms_norm_kernel, dict(BLOCK_H=4096, PDL=True), {}, ("eps",),
            arn.NUM_WARPS, releases_early=True)
    # The FP8 GEMV (impl/head/fp8_gemv.py) on each path: the head's scales per row, and the FP8
    # checkpoints' scales per block of 128 x 128 applied per K tile.
    from impl.head import fp8_gemv as fg
    for path, rows in (("split", 8), ("dot", 16), ("fma", 4)):
        for scale in ("row", "block"):
            attempt(f"fp8_gemv_kernel path={path} scale={scale}", fg.fp8_gemv_kernel,
                    dict(SCALE=2 if scale == "block" else 1, SCALE_BN=128, SCALE_BK=128, BLOCK_M=rows, BLOCK_N=64,
                         BLOCK_K=128, PATH=fg._PATH_IDS[path], EVEN_K=True, IEEE_DOT=False, FP32_MATH=False),
                    dict(w_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*bf16"))
    routing_ptrs = dict(ids_ptr="*i32", slot_expert_ptr="*i32", slot_weight_ptr="*fp32",
                        slot_tokens_ptr="*i32", weights_ptr="*fp32", logits_ptr="*fp32", bias_ptr="*fp32",
                        w_ptr="*fp32", x_ptr="*bf16", xq_ptr="*i32", xs_ptr="*fp32")
    # The router's top-k at the Ling-3.0-flash shape (512 experts in 8 groups, top 4, top 8).
    meta = dict(ROUTER=1, RENORMALIZE=True, HAS_BIAS=True, N_GROUP=8, TOPK_GROUP=4, ROWS=1, M_PAD=M_PAD,
                E_PAD=512, K_PAD=8, S_PAD=8, PDL=True)
    attempt("router_topk_kernel 1 warp", tr.router_topk_kernel, meta, routing_ptrs, ("routed_scaling",), 1)
    attempt("router_topk_kernel softmax 4 rows", tr.router_topk_kernel,
            dict(meta, ROUTER=0, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1, ROWS=4), routing_ptrs, ("routed_scaling",))
    for split_x in (False, True):
        attempt(f"router_logits_kernel 4 rows split_x={split_x} pdl={split_x}", tr.router_logits_kernel,
                dict(ROWS=4, BLOCK_E=2, BLOCK_K=4096, SPLIT_X=split_x, PDL=split_x, PREFETCH=split_x), routing_ptrs)
    # Negative controls of the static checks: each flags its planted defect, and only that.
    import planted_kernels as pk  # beside this file, which runs as a script
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
    for fn, planted in ((pk.reduces_after_the_loop, False), (pk.loads_ahead_in_one_rotating_set, True)):
        copies = loop_load_copies(compile_one(fn, {}, dict(w_ptr="*fp32", out_ptr="*fp32")).asm["cubin"])
        ok = (len(copies) > LOAD_COPY_TOLERANCE) == planted
        failures += not ok
        print("OK  " if ok else "FAIL", f"load copy check on {fn.__name__}: flagged {copies[:2]}", flush=True)
    print("failures:", failures)
    return failures


def _preset(key: dict):
    """The model preset of a tuned shape, or None."""
    from impl.model.config import PRESETS, get_config
    for name in PRESETS:
        c = get_config(name)
        if (c.num_experts, c.hidden_size, c.moe_intermediate_size, c.top_k) == (
                key["experts"], key["hidden"], key["intermediate"], key["top_k"]):
            return c
    return None


def _shared_width(key: dict) -> int:
    """The shared expert's width for a tuned shape: the matching preset's, else one of width I."""
    preset = _preset(key)
    return preset.shared_intermediate_size if preset else key["intermediate"]


def config_resources(key: dict, config: dict) -> list[dict]:
    """For one tuned entry (tuned_configs.json: key and config), each expert kernel as
    `expert_launch` would launch it at the key's M bucket (top-k distinct experts a token),
    built for sm_90: name, registers, spilled bytes a thread, shared memory, programs an SM, and
    the grid's programs over what the SMs hold at once (waves)."""
    from impl.moe import triton_experts as te
    from impl.moe.moe_launch_config import MoELaunchConfig
    from impl.moe.triton_launch import expert_launch, gemv_rows, resident_programs
    cfg = MoELaunchConfig(**config)
    mxfp4 = key["format"] == "mxfp4"
    m = key["m_bucket"]
    launch = expert_launch(cfg, tokens=m, num_slots=min(m * key["top_k"], key["experts"]), hidden=key["hidden"],
                           inter=key["intermediate"], i_shared=_shared_width(key), mxfp4=mxfp4, pdl=cfg.pdl)
    dp4a = mxfp4 and gemv_rows(cfg, m) > 0
    ptr_types = _moe_ptr_types(("*i32" if dp4a else "*u8") if mxfp4 else "*bf16", dp4a)
    rows = []
    for name, fn, k in (("gate_up", te.moe_gate_up_kernel, launch.gate_up), ("down", te.moe_down_kernel, launch.down)):
        compiled = compile_one(fn, k.consts, ptr_types, floats=GATE_UP_FLOATS, num_warps=k.num_warps,
                               num_stages=k.num_stages)
        regs, spilled = resources(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        per_sm = resident_programs(regs, k.num_warps, shared)
        rows.append(dict(kernel=name, warps=k.num_warps, regs=regs, spilled=spilled, shared=shared, per_sm=per_sm,
                         programs=k.grid[0] * k.grid[1], waves=k.grid[0] * k.grid[1] / (per_sm * SMS),
                         load_copies=len(loop_load_copies(compiled.asm["cubin"]))))
    return rows


# Bytes a thread may keep on the stack. Triton 3.9's ptxas put 8 bytes of a committed down kernel
# there (2 warps at the 255-register cap) where the H200's Triton 3.6 put none: a few words, read
# back from L1. The cliffs this check guards against spill hundreds of bytes and more (the planted
# config below: 880 bytes; bf16 tiles of 128 x 512: 25 to 28 KB).
SPILL_TOLERANCE = 64

# Registers of loads a kernel's plain-weight loops may copy into a later pass. Triton 3.9's build of
# the Ling-3.0-flash MXFP4 gate_up kernel copies one (of a masked 16-byte load, under its mask);
# the H200's Triton 3.6 none. The defect this check guards against copied whole tiles: 8 registers
# a K step in the shared expert's loop (one memory round trip a step), 8 in the planted kernel.
LOAD_COPY_TOLERANCE = 2

# The spill check's negative control: the Ling-3.0-flash MXFP4 decode config with a down tile of
# 128 rows over 2 warps (ptxas keeps 255 registers and puts 880 bytes a thread on the stack).
PLANTED_KEY = dict(experts=512, hidden=2560, intermediate=768, top_k=8, m_bucket=1, format="mxfp4")
PLANTED_SPILL = dict(gate_up_block_n=32, gate_up_block_k=512, gate_up_warps=8, down_block_n=128, down_block_k=128,
                     down_warps=2, gemv_max_tokens=4, shared_split=2, shared_block_k=128,
                     gate_up_lookahead=1, down_lookahead=1, pdl=True, l2_prefetch=True)


def _check_configs() -> int:
    """Every committed launch config's expert kernels built for sm_90 as `expert_launch` gives
    them: none may spill more than SPILL_TOLERANCE bytes a thread (a config tuned on the GPU
    silently loses its speed when a kernel change makes its tiles spill: bf16 K tiles of 512
    spilled and ran 2 to 4x slower on the H200), and no plain-weight loop may copy a load in the pass that
    issued it (`loop_load_copies`: the shared expert's loop did, and each of its K steps waited a
    memory round trip). Prints each kernel's resources; a planted spilling config is the negative
    control of the first, the planted kernels of `_compile_all` of the second."""
    import json
    from impl.moe.moe_launch_config import TABLE
    failures = 0
    for entry in json.loads(TABLE.path.read_text()):
        key = entry["key"]
        shape = f"{key['format']} E={key['experts']} H={key['hidden']} I={key['intermediate']} M={key['m_bucket']}"
        for r in config_resources(key, entry["config"]):
            bad = r["spilled"] > SPILL_TOLERANCE or r["load_copies"] > LOAD_COPY_TOLERANCE
            failures += bad
            print("FAIL" if bad else "OK  ", shape, " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in r.items()), flush=True)
    spilling = config_resources(PLANTED_KEY, PLANTED_SPILL)
    ok = [r["kernel"] for r in spilling if r["spilled"] > SPILL_TOLERANCE] == ["down"]
    failures += not ok
    print("OK  " if ok else "FAIL", f"spill check on a planted config: {spilling}", flush=True)
    print("failures:", failures)
    return failures


def _run_child(*args: str) -> None:
    """This file run in a child process with the interpreter off; fails on its failures."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    if "ptxas" in out and ("not found" in out or "No such file" in out):
        pytest.skip(f"no ptxas for this Triton: {out[-300:]}")
    assert proc.returncode == 0 and "failures: 0" in proc.stdout, out[-4000:]


def test_kernels_compile_for_sm90():
    _run_child()


def test_committed_configs_neither_spill_nor_copy_loads_on_sm90():
    """`_check_configs`: every committed config's kernels, as built for the H200."""
    _run_child("configs")


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    if sys.argv[1:] == ["configs"]:
        sys.exit(1 if _check_configs() else 0)
    sys.exit(1 if _compile_all(TILES + (MORE_TILES if sys.argv[1:] == ["all"] else [])) else 0)
