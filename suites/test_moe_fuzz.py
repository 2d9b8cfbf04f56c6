"""Property-based fuzzing of the MoE backend under test against the fp32 oracle `moe_reference`.

Drawn per example: experts 1..512, top-k 1..min(E, 16), H, I and the shared expert's I multiples
of 32 (powers of two and not: 32, 96, 160, ...), M 1..16 tokens; routing uniform, skewed (every
token to one expert; every token to the same set of experts) or tied (equal weights on explicit
ids, as tied router scores give); magnitudes 1e-4, 1 and 1e4 for the activations and the weights
separately; routed experts in bf16 (also fp32 on a CPU) or MXFP4; the shared expert on or off.
Separate properties: a NaN in one input row reaches exactly that output row, a NaN in one
expert's weights exactly the tokens that chose it; the MXFP4 decode is right for every E2M1 code
at every E8M0 scale (weights built code by code, read back one at a time).

Example counts come from the hypothesis profile (repo conftest: "ci" derandomized with 30
examples, "fuzz" 2000 for `tox -e fuzz`); each property takes its share of that count. On a CPU
the kernels run in Triton's interpreter (~5 ms per program and K step), so each example's shapes
are drawn under a cost budget (`interpreter_cost`) that keeps it under ~0.5 s: large E comes with
small H, I, M or k; the expert count and top-k are drawn by range first (1-8, 9-64, 65-512; 1-2,
3-8, 9-16) so that each range comes up. The ends of the ranges (512 experts at top-16, every token on every expert,
16 tokens on one expert, tied weights with the shared expert) also run as fixed cases every time.

Backends under test and tolerances are the parity suite's (test_moe_parity.py has the
derivation): per token row, ||out - ref|| / ||ref|| <= 1e-5 on a CPU (fp32 math throughout),
1e-2 on a GPU (bf16 activations and intermediate). Norm-wise relative error is independent of
the magnitude, so the same bound holds at 1e-4 and 1e4 (the largest values drawn, ~1e21, and the
smallest, ~1e-21, stay inside fp32's and bf16's normal range).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis.control import currently_in_test_context
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

from impl import backends
from impl.moe.reference import InputSnapshot, moe_reference
from impl.moe.shared import SharedExpert
from impl.quant.mxfp4 import MXFP4Tensor, pack_nibbles, quantize_mxfp4

# Large magnitudes, NaN and inf make numpy (the interpreter) warn about overflow in exp and
# invalid values in products: expected here, the results are what is checked.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

RTOL_FP32 = 1e-5
RTOL_BF16 = 1e-2
DIMS = (32, 64, 96, 128, 160, 192, 256, 320)
MAGNITUDES = (1e-4, 1.0, 1e4)
ROUTINGS = ("uniform", "one-expert", "same-set", "tied")

# Interpreter cost budget per example, in "program-steps" (see interpreter_cost), and a cap on
# the weight elements generated (E * 3 * I * H). On a GPU both are effectively unbounded.
CPU_BUDGET, GPU_BUDGET = 64, 1 << 20
CPU_MAX_ELEMENTS, GPU_MAX_ELEMENTS = 1 << 21, 1 << 24


def _share(fraction: float, floor: int = 3) -> int:
    """This property's number of examples: a fraction of the loaded profile's."""
    return max(floor, int(settings.default.max_examples * fraction))


def fuzz_settings(fraction: float):
    # filter_too_much: a backend refusing many drawn cases (a peer's shape limits) has them rejected,
    # not the property ended; `reports_refusals` fails a property whose every case was refused.
    return settings(max_examples=_share(fraction), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="session")
def backend(moe_checked_backend):
    """Each backend under test (the plugin parametrizes it: `--moe-backend`, plus `triton` on a CPU)."""
    return moe_checked_backend


# --- cases ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    experts: int
    top_k: int
    tokens: int
    hidden: int
    inter: int
    shared_inter: int | None
    fmt: str  # "bf16", "fp32" (CPU only) or "mxfp4"
    routing: str
    x_mag: float
    w_mag: float
    seed: int

    @property
    def slots(self) -> int:
        return min(self.tokens * self.top_k, self.experts)


def interpreter_cost(hidden: int, inter: int, shared_inter: int | None, slots: int, fmt: str) -> int:
    """Program x K-step count of the Triton kernels' grids (gate_up: one program per slot and
    32 columns of I, each stepping through H by 128; down: one per 32 of H, stepping through
    every slot's I by 128), doubled for MXFP4, whose decode costs as much again in the interpreter."""
    c = lambda a, b: -(-a // b)  # noqa: E731
    i_max = max(inter, shared_inter or 0)
    gate_up = (slots + (shared_inter is not None)) * c(i_max, 32) * c(hidden, 128)
    down = c(hidden, 32) * (slots * c(inter, 128) + (c(shared_inter, 128) if shared_inter else 0))
    return (gate_up + down) * (2 if fmt == "mxfp4" else 1)


# Drawn first, so that many experts and large top-k come up too: drawn freely under the CPU's cost
# budget, 30 examples gave top-k 1 or 2 only.
EXPERT_RANGES = ((1, 8), (9, 64), (65, 512))
TOP_K_RANGES = ((1, 2), (3, 8), (9, 16))


@st.composite
def cases(draw, device: torch.device, formats: tuple[str, ...]) -> Case:
    cpu = device.type != "cuda"
    budget = CPU_BUDGET if cpu else GPU_BUDGET
    max_elements = CPU_MAX_ELEMENTS if cpu else GPU_MAX_ELEMENTS
    fmt = draw(st.sampled_from(formats))
    shared_inter = draw(st.none() | st.sampled_from(DIMS))
    e_lo, e_hi = draw(st.sampled_from(EXPERT_RANGES))
    k_lo, k_hi = draw(st.sampled_from(TOP_K_RANGES))
    fits = lambda h, i, s: interpreter_cost(h, i, shared_inter, s, fmt) <= budget  # noqa: E731
    # top-k <= E (a few experts take top-k up to their count), and k_lo slots must fit the budget
    # at the smallest shapes (a wide shared expert leaves room for few).
    k_lo = min(k_lo, e_hi, max(s for s in range(1, 17) if fits(DIMS[0], DIMS[0], s)))
    e_lo = max(e_lo, k_lo)
    # Shapes where one token's k_lo slots fit the budget and whose weights fit for e_lo experts.
    dims = [(h, i) for h in DIMS for i in DIMS if fits(h, i, k_lo) and e_lo * 3 * h * i <= max_elements]
    hidden = draw(st.sampled_from(sorted({h for h, _ in dims})))
    inter = draw(st.sampled_from([i for h, i in dims if h == hidden]))
    max_slots = max(s for s in range(1, 257) if fits(hidden, inter, s))
    tokens = draw(st.sampled_from(range(1, 17)))
    e_max = min(e_hi, max_elements // (3 * hidden * inter))
    # slots = min(M * k, E) <= max_slots: E small, or M * k small.
    if tokens * k_lo > max_slots:
        if e_lo <= max_slots:
            e_max = min(e_max, max_slots)
        else:
            tokens = max_slots // k_lo
    experts = draw(st.integers(e_lo, e_max))
    k_max = min(experts, k_hi) if experts <= max_slots else min(k_hi, max_slots // tokens)
    top_k = draw(st.integers(k_lo, k_max))
    return Case(experts, top_k, tokens, hidden, inter, shared_inter, fmt,
                routing=draw(st.sampled_from(ROUTINGS)), x_mag=draw(st.sampled_from(MAGNITUDES)),
                w_mag=draw(st.sampled_from(MAGNITUDES)), seed=draw(st.integers(0, 2**31 - 1)))


def activation_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tolerance(device: torch.device) -> float:
    return RTOL_BF16 if device.type == "cuda" else RTOL_FP32


def tolerance_reason(tol: float) -> str:
    if tol == RTOL_FP32:
        return ("fp32 activations on a CPU: fp32 math expected throughout; a backend that computes in bf16 "
                f"is checked on a GPU, at {RTOL_BF16:g}")
    if tol == RTOL_BF16:
        return "bf16 activations and intermediate on a GPU (derivation: test_moe_parity.py)"
    return "this kernel variant's, derived where it is chosen"


def _routing(case: Case, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, k], ids int64 [M, k]): distinct experts per token, as a router gives."""
    m, k, e = case.tokens, case.top_k, case.experts
    perms = torch.stack([torch.randperm(e, generator=g) for _ in range(m)])
    if case.routing == "one-expert":  # every token chooses expert `hot` (at a random position)
        hot = int(torch.randint(e, (1,), generator=g))
        others = torch.stack([p[p != hot][:k - 1] for p in perms])
        ids = torch.cat([torch.full((m, 1), hot), others], dim=1)
        ids = torch.stack([row[torch.randperm(k, generator=g)] for row in ids])
    elif case.routing == "same-set":  # every token chooses the same k experts, in its own order
        chosen = perms[0][:k]
        ids = torch.stack([chosen[torch.randperm(k, generator=g)] for _ in range(m)])
    else:
        ids = perms[:, :k]
    if case.routing == "tied":  # tied router scores: equal weights, the ids given explicitly
        weights = torch.full((m, k), float(torch.rand((), generator=g)) * 2.5 + 0.05)
    else:
        weights = (torch.rand(m, k, generator=g) * 0.95 + 0.05) * 2.5
    return weights, ids


def _weight(shape: tuple[int, ...], mag: float, g: torch.Generator) -> torch.Tensor:
    """randn / sqrt(fan_in) * mag, with a factor 2**U(-2, 2) per block of 32 along the fan-in
    (different MXFP4 scales within a row)."""
    w = torch.randn(shape, generator=g) * (mag / math.sqrt(shape[-1]))
    blocks = torch.exp2(torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=g) * 4 - 2)
    return w * blocks.expand(*shape[:-1], shape[-1] // 32, 32).reshape(shape)


def _routed(w: torch.Tensor, fmt: str):
    return quantize_mxfp4(w) if fmt == "mxfp4" else w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)


def make_inputs(case: Case, device: torch.device, nan: str | None = None, nan_at: tuple[int, int] = (0, 0)):
    """x, weights, ids, w_gate_up, w_down, shared for `case` (built on the CPU, then moved).
    nan="x" puts a NaN at x[nan_at]; nan="expert" one in the gate_up weight of the expert that
    token nan_at[0] chose first, at column nan_at[1]."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = activation_dtype(device)
    h, i = case.hidden, case.inter
    x = torch.randn(case.tokens, h, generator=g) * case.x_mag
    weights, ids = _routing(case, g)
    w_gate_up = _weight((case.experts, 2 * i, h), case.w_mag, g)
    w_down = _weight((case.experts, h, i), case.w_mag, g)
    if nan == "x":
        x[nan_at] = float("nan")
    elif nan == "expert":
        w_gate_up[int(ids[nan_at[0], 0]), nan_at[1] % (2 * i), nan_at[1] % h] = float("nan")
    shared = None
    if case.shared_inter is not None:
        s = case.shared_inter
        shared = SharedExpert(_weight((s, h), case.w_mag, g).to(device, dtype),
                              _weight((s, h), case.w_mag, g).to(device, dtype),
                              _weight((h, s), case.w_mag, g).to(device, dtype))
    return (x.to(device, dtype), weights.to(device), ids.to(device), _routed(w_gate_up, case.fmt).to(device),
            _routed(w_down, case.fmt).to(device), shared)


@pytest.fixture(scope="session")
def formats(backend, moe_device) -> tuple[str, ...]:
    """The weight formats drawn for this backend: those it declares (`Backend.formats`) of bf16
    (and fp32 on a CPU) and MXFP4. Drawing a format only to skip the whole property on it would
    skip every example."""
    candidates = ("bf16", "mxfp4") if moe_device.torch_device.type == "cuda" else ("bf16", "fp32", "mxfp4")
    drawn = tuple(f for f in candidates if f in backend.formats)
    if not drawn:
        pytest.skip(f"backend {backend.name!r} takes none of the formats {candidates} on this device")
    return drawn


def skip_without_mxfp4(formats, backend) -> None:
    if "mxfp4" not in formats:
        pytest.skip(f"backend {backend.name!r} does not take MXFP4 experts (Backend.formats)")


# The refusals of the backend under test in the current property (`reports_refusals`).
_refused: list[str] = []


def reports_refusals(prop):
    """A property whose every drawn case the backend refused fails saying so, with the first
    refusal (hypothesis alone would say it could not satisfy its assumptions)."""
    @functools.wraps(prop)
    def run(*args, **kwargs):
        _refused.clear()
        try:
            return prop(*args, **kwargs)
        except Unsatisfiable:
            if not _refused:
                raise
            pytest.fail(f"the backend refused every drawn case ({len(_refused)}), e.g. {_refused[0]}: nothing was "
                        "checked", pytrace=False)
    return run


def run_backend(backend, inputs):
    """The backend's output, after checking that it (and only it) recorded the kernels it ran and
    that it left its inputs as they were. A drawn case the backend declines
    (`backends.Unsupported`, e.g. a peer library's shape limits) is rejected and another drawn in
    its place, so one refusal does not end the property (`reports_refusals`); outside a property
    the test skips, saying why."""
    names = ("x", "weights", "ids", "w_gate_up", "w_down", "shared")
    before = InputSnapshot(**dict(zip(names, inputs)))
    with backends.record_provenance() as prov:
        try:
            out = backend.fn(*inputs)
        except backends.Unsupported as e:
            if not currently_in_test_context():
                pytest.skip(f"backend {backend.name!r} does not cover this case: {e}")
            _refused.append(str(e))
            note(f"backend {backend.name!r} does not cover this case: {e}")
            reject()
    changed = before.changed(**dict(zip(names, inputs)))
    assert not changed, f"backend {backend.name!r} changed its input(s) {changed} in place"
    ran = {e.backend for e in prov.events if e.kind == "moe"}
    assert ran, (f"backend {backend.name!r} recorded no moe kernels: each call notes what ran "
                 "(impl.backends.note), and the suites check it")
    assert ran == {backend.name}, f"provenance names backends {sorted(ran)}, expected only {backend.name!r}"
    x = inputs[0]
    assert isinstance(out, torch.Tensor) and (out.shape, out.dtype, out.device) == (x.shape, x.dtype, x.device), (
        f"backend {backend.name!r} returned {_described(out)} for x {_described(x)}: a MoE backend returns "
        "x's shape [T, H], dtype and device")
    return out


def _described(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def reference(inputs):
    x, *rest = inputs
    return moe_reference(x.float(), *rest)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str, rows=None) -> None:
    assert out.shape == ref.shape, f"{what}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    rows = list(range(out.shape[0])) if rows is None else list(rows)
    o, r = out.double()[rows], ref.double()[rows]
    rel = (o - r).norm(dim=-1) / r.norm(dim=-1)
    bad = [row for row, e in zip(rows, rel.tolist()) if not e <= tol]
    assert not bad, (f"{what}: relative error per token row {[f'{e:.3g}' for e in rel.tolist()]} "
                     f"exceeds the tolerance {tol:g} ({tolerance_reason(tol)}) in rows {bad}")


# --- properties -----------------------------------------------------------------------------

@reports_refusals
@fuzz_settings(1.0)
@given(data=st.data())
def test_fuzz_matches_reference(backend, moe_device, formats, data):
    device = moe_device.torch_device
    case = data.draw(cases(device, formats), label="case")
    inputs = make_inputs(case, device)
    out = run_backend(backend, inputs)
    assert_rows_close(out, reference(inputs), tolerance(device), f"{backend.name} vs moe_reference, {case}")


# The ends of the drawn ranges, every run: the derandomized CI profile's 30 examples, drawn under the
# interpreter's cost budget, mostly come out with few experts and small top-k. Each corner fits the
# CPU budget (H = I = 32: 16 slots, or 8 and the shared expert, are 64 program-steps or fewer in MXFP4).
CORNERS = {
    "512 experts, top-16, one token (a large model's decode step)": dict(experts=512, top_k=16, tokens=1),
    "every token picks every expert": dict(experts=16, top_k=16, tokens=2),
    "16 tokens on one expert of 300": dict(experts=300, top_k=1, tokens=16, routing="one-expert"),
    "16 tokens on the same 8 of 8, tied weights, shared expert": dict(experts=8, top_k=8, tokens=16, routing="tied",
                                                                      shared_inter=32),
}


@pytest.mark.parametrize("corner", list(CORNERS))
def test_matches_reference_at_the_ends_of_the_drawn_ranges(backend, moe_device, formats, corner):
    device = moe_device.torch_device
    for fmt in formats:
        case = Case(**{"hidden": 32, "inter": 32, "shared_inter": None, "routing": "uniform", "x_mag": 1.0,
                       "w_mag": 1.0, "seed": 7, "fmt": fmt, **CORNERS[corner]})
        assert interpreter_cost(case.hidden, case.inter, case.shared_inter, case.slots, fmt) <= CPU_BUDGET
        inputs = make_inputs(case, device)
        assert_rows_close(run_backend(backend, inputs), reference(inputs), tolerance(device),
                          f"{backend.name} vs moe_reference, {case}")


@reports_refusals
@fuzz_settings(0.35)
@given(data=st.data())
def test_fuzz_nan_reaches_exactly_its_rows(backend, moe_device, formats, data):
    """A NaN in x[t] makes row t all NaN and leaves every other row finite and right; a NaN in one
    expert's weights does so for exactly the tokens that chose that expert (in particular a token
    that did not choose it must add nothing, not 0 * NaN)."""
    device = moe_device.torch_device
    case = data.draw(cases(device, formats), label="case")
    where = data.draw(st.sampled_from(("x", "expert")), label="nan in")
    row = data.draw(st.integers(0, case.tokens - 1), label="row")
    col = data.draw(st.integers(0, 2 * max(case.hidden, case.inter) - 1), label="column")
    inputs = make_inputs(case, device, nan=where, nan_at=(row, col % case.hidden if where == "x" else col))
    ids = inputs[2].cpu()
    if where == "x":
        poisoned = {row}
    else:
        expert = int(ids[row, 0])
        poisoned = {t for t in range(case.tokens) if expert in ids[t].tolist()}
    out = run_backend(backend, inputs).cpu()
    what = f"{backend.name}, NaN in {where} at row {row}: {case}"
    for t in sorted(poisoned):
        assert out[t].isnan().all(), f"{what}: row {t} should be all NaN, has {int(out[t].isnan().sum())} NaN"
    clean = [t for t in range(case.tokens) if t not in poisoned]
    assert out[clean].isfinite().all(), (
        f"{what}: the NaN leaked into rows {[t for t in clean if not out[t].isfinite().all()]}")
    assert_rows_close(out, reference(inputs).cpu(), tolerance(device), what, rows=clean)


# --- MXFP4 decode over every code and the whole scale range --------------------------------

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ONE, ZERO = 2, 0  # E2M1 codes of 1.0 and +0
UNIT_SCALE = 127  # E8M0 code of 2**0
DECODE_N = 128  # H = I: identity-like operands need a square down / up projection


def e2m1_value(code: int) -> float:
    """Independent of impl.quant: bit 3 sign, bits 0-2 index the magnitudes."""
    return (-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7]


def decoded(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [R, C] (uint8 0..15), scales [R, C/32] (E8M0) -> float32, computed in float64 so
    every finite product is exact before the one rounding to float32."""
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    scale = torch.where(scales == 255, math.nan, torch.exp2(scales.double() - 127))
    return (table[codes.long()] * scale.repeat_interleave(32, dim=-1)).float()


def mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
    return MXFP4Tensor(pack_nibbles(codes.to(torch.uint8)), scales.to(torch.uint8))


def constant_codes(rows: int, cols: int, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((rows, cols), code, dtype=torch.uint8), torch.full((rows, cols // 32), UNIT_SCALE, dtype=torch.uint8)


def identity_codes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.full((n, n), ZERO, dtype=torch.uint8)
    codes.fill_diagonal_(ONE)
    return codes, torch.full((n, n // 32), UNIT_SCALE, dtype=torch.uint8)


def pattern_codes(rows: int, cols: int, scale_codes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Element (r, c) has code (r + c) % 16, so each block of 32 holds all 16 codes twice; the
    blocks take the scale codes in turn. A code whose value would overflow fp32 at its block's
    scale (|v| * 2**(s-127) >= 2**128: codes 2.0-6.0 at 2**127, 4.0-6.0 at 2**126) becomes 0.5:
    an infinity in one weight would make NaN (0 * inf) of its whole readback row; overflow has its
    own test below."""
    codes = ((torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % 16).to(torch.uint8)
    nblocks = rows * (cols // 32)
    scales = torch.tensor([scale_codes[b % len(scale_codes)] for b in range(nblocks)]).view(rows, cols // 32)
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[(codes & 7).long()]
    overflow = mag * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1) >= 2.0**128
    codes = torch.where(overflow, (codes & 8) | 1, codes)
    return codes, scales.to(torch.uint8)


def decode_probe(role: str, scale_codes: list[int]):
    """One expert whose `role` weight ("gate", "up" or "down") holds the code pattern while the
    others are constants or identities, so token m = one-hot x at column m reads back column m
    of the pattern, one weight per output element:
      gate: up = 1, down = I  ->  out[m, h] = silu(Wg[h, m])
      up:   gate = 1, down = I  ->  out[m, h] = silu(1) * Wu[h, m]
      down: gate = 1, up = I  ->  out[m, h] = silu(1) * Wd[h, m]
    Returns (w_gate_up, w_down, the pattern's exact values)."""
    n = DECODE_N
    pattern = pattern_codes(n, n, scale_codes)
    gate = pattern if role == "gate" else constant_codes(n, n, ONE)
    up = pattern if role == "up" else (identity_codes(n) if role == "down" else constant_codes(n, n, ONE))
    down = pattern if role == "down" else identity_codes(n)
    gate_up = mxfp4(torch.cat([gate[0], up[0]])[None], torch.cat([gate[1], up[1]])[None])
    return gate_up, mxfp4(down[0][None], down[1][None]), decoded(*pattern)


def decode_readback(backend, device, gate_up, down, ids=None):
    """Token m = one-hot x at column m, routed with weight 1 to expert ids[m] (default 0)."""
    n = DECODE_N
    dtype = activation_dtype(device)
    x = torch.eye(n, dtype=dtype, device=device)
    weights = torch.ones(n, 1, device=device)
    ids = torch.zeros(n, 1, dtype=torch.long) if ids is None else ids
    inputs = (x, weights, ids.to(device), gate_up.to(device), down.to(device), None)
    return run_backend(backend, inputs).float().cpu(), reference(inputs).cpu()


ALL_SCALES = list(range(255))  # every finite E8M0 code: 2**-127 (an fp32 subnormal) .. 2**127


@pytest.mark.parametrize("role", ["gate", "up", "down"])
def test_mxfp4_decode_every_code_and_scale(backend, moe_device, formats, role):
    """Every E2M1 code at every finite E8M0 scale, in each of the three routed weights, read back
    one element at a time. Tolerance on a CPU: rtol 1e-5 (the readback multiplies by silu(1) in
    fp32: a few ulps), atol 0, so even the subnormal results at 2**-127 must be right; for the
    gate, atol 2**-126 as well: silu(g) for g in about (-104, -88) is an fp32 subnormal that the
    kernel's g / (1 + exp(-g)) flushes to 0 (exp overflows) while torch keeps it. On a GPU,
    rtol 2**-7: the activation and the output are bf16 (two roundings of 2**-9), and results
    below bf16's normal range (scales under 2**-124) are left out, as tensor cores flush them."""
    skip_without_mxfp4(formats, backend)
    device = moe_device.torch_device
    gpu = device.type == "cuda"
    scales = [s for s in ALL_SCALES if s >= 3] if gpu else ALL_SCALES
    gate_up, down, values = decode_probe(role, scales)
    out, ref = decode_readback(backend, device, gate_up, down)
    readback = values.t()  # out[m, h] reads pattern[h, m]
    silu = torch.nn.functional.silu
    expected = silu(readback) if role == "gate" else silu(torch.tensor(1.0)) * readback
    rtol = 2**-7 if gpu else 1e-5
    atol = 2.0**-126 if role == "gate" else 0.0
    # The oracle itself against the independent decode, then the backend against the oracle.
    torch.testing.assert_close(ref, expected, rtol=1e-6, atol=atol, msg=lambda m: f"moe_reference, {role}: {m}")
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol,
                               msg=lambda m: f"{backend.name} MXFP4 decode of the {role} weight: {m}")


def test_mxfp4_nan_scale_and_overflow_reach_exactly_their_tokens(backend, moe_device, formats):
    """E8M0 code 255 is NaN: every element of its block decodes to NaN; 6 * 2**127 overflows fp32
    to inf. Three experts with the decode probe's up pattern: expert 1 has scale 255 on one block
    (row 5, columns 32..63), expert 2 scale 254 on row 9, columns 96..127, with 6.0 at column 100.
    A non-finite weight reaches every token that chose its expert, through 0 * NaN or 0 * inf in
    the one-hot product, and no other token, even in the same 16-token chunk. Token 100 (x one-hot
    at column 100) reads the inf itself: up[9] = inf, so out[100, 9] = inf through the identity
    down projection (its other elements are 0 * inf = NaN)."""
    skip_without_mxfp4(formats, backend)
    device = moe_device.torch_device
    n = DECODE_N
    gate = constant_codes(n, n, ONE)
    up_codes, up_scales = pattern_codes(n, n, list(range(110, 145)))
    up_nan_scales = up_scales.clone()
    up_nan_scales[5, 1] = 255
    up_inf_codes, up_inf_scales = up_codes.clone(), up_scales.clone()
    up_inf_scales[9, 3] = 254
    up_inf_codes[9, 96:128] = 1  # 0.5 * 2**127: finite
    up_inf_codes[9, 100] = 7  # 6 * 2**127 = inf
    experts = [(up_codes, up_scales), (up_codes, up_nan_scales), (up_inf_codes, up_inf_scales)]
    gate_up = mxfp4(torch.stack([torch.cat([gate[0], c]) for c, _ in experts]),
                    torch.stack([torch.cat([gate[1], s]) for _, s in experts]))
    down = identity_codes(n)
    down = mxfp4(down[0].expand(3, n, n).contiguous(), down[1].expand(3, n, n // 32).contiguous())
    ids = torch.zeros(n, 1, dtype=torch.long)
    ids[[40, 41]] = 1
    ids[[100, 101]] = 2
    out, ref = decode_readback(backend, device, gate_up, down, ids)
    poisoned = {40, 41, 100, 101}
    for t in range(n):
        if t in poisoned:
            assert not out[t].isfinite().any(), f"{backend.name}: token {t} chose a NaN/inf expert, row is finite"
            assert not ref[t].isfinite().any()
        else:
            assert out[t].isfinite().all(), f"{backend.name}: non-finite values leaked into token {t}"
    assert out[100, 9] == float("inf") and ref[100, 9] == float("inf"), (out[100, 9], ref[100, 9])
    assert out[40].isnan().all() and out[101].isnan().all(), f"{backend.name}: NaN scale should give NaN rows"
    clean = [t for t in range(n) if t not in poisoned]
    rtol = 2**-7 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out[clean], ref[clean], rtol=rtol, atol=0.0)


# --- the Triton MoE's MXFP4 product paths (MoELaunchConfig.gemv_max_tokens) -----------------

def triton_variants():
    """name -> launch config of each MXFP4 product path the tuner may pick: tensor-core tiles
    throughout, or the register path's dp4a products up to 4 tokens; the tiles are the defaults'
    (32 x 128), so `interpreter_cost` still bounds an example's time."""
    from impl.moe.moe_launch_config import MoELaunchConfig
    return {"dot-bits": MoELaunchConfig(), "gemv-dp4a": MoELaunchConfig(gemv_max_tokens=4)}


def skip_unless_triton_mxfp4(backend, formats) -> None:
    if backend.name != "triton":
        pytest.skip("launch-config variants are the Triton backend's")
    skip_without_mxfp4(formats, backend)


def run_variant(inputs, variant: str, **tiles):
    """The Triton MoE on `inputs` with the variant's launch config (tile fields overridden by
    `tiles`), checking that the product the variant names is what ran on each chunk."""
    from impl.moe.moe_launch_config import M_PAD
    from impl.moe.triton_backend import moe_triton
    cfg = dataclasses.replace(triton_variants()[variant], **tiles)
    with backends.record_provenance() as prov:
        out = moe_triton(*inputs, config=cfg)
    ran = {e.config["product"] for e in prov.events if "product" in e.config}
    m = inputs[0].shape[0]
    expect = {variant if min(M_PAD, m - i) <= cfg.gemv_max_tokens else "dot-bits" for i in range(0, m, M_PAD)}
    assert ran == expect, f"variant {variant}: products {ran} ran, expected {expect}"
    return out


def variant_tolerance(device: torch.device, variant: str) -> float:
    """The suite's tolerance, except dp4a on a CPU: its int8 split of x and of the intermediate
    activations errs by up to 2**-13 of each block of 32's largest magnitude, in norm 2**-13 *
    sqrt(32) = 6.9e-4 of a row per split, two splits (impl/moe/triton_dp4a.py); on a GPU the
    bf16 roundings of every variant dominate."""
    return max(tolerance(device), 2e-3) if "dp4a" in variant else tolerance(device)


@reports_refusals
@fuzz_settings(0.35)
@given(data=st.data())
def test_fuzz_triton_mxfp4_variants_match_reference(backend, moe_device, formats, data):
    """Every MXFP4 product path against the oracle at the suite's tolerance, on drawn MXFP4 cases
    (M 1..16: the register path runs at M <= 4, tensor cores above)."""
    skip_unless_triton_mxfp4(backend, formats)
    device = moe_device.torch_device
    case = data.draw(cases(device, ("mxfp4",)), label="case")
    variant = data.draw(st.sampled_from(sorted(triton_variants())), label="variant")
    inputs = make_inputs(case, device)
    out = run_variant(inputs, variant)
    assert_rows_close(out, reference(inputs), variant_tolerance(device, variant),
                      f"triton {variant} vs moe_reference, {case}")
