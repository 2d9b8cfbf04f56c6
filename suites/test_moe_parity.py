"""Parity of the MoE backend under test with the fp32 oracle `moe_reference`.

For M in {1, 2, 4, 16} tokens (a decode step, small verify steps, a full M_PAD chunk), routed
experts in bf16 and in MXFP4 (and in fp32 on a CPU, the CPU model's format), with and without the
shared expert:
- tiny shapes on every device (CPU in the default run: fp32 activations, and Triton in its
  interpreter);
- the Ling-3.0-flash (E=512, top-8, H=2560, I=768, shared I=768) and Ling-flash-2.0 (E=256,
  top-8, H=4096, I=1024, shared I=1024) shapes, marked `gpu` (bf16 activations).

A backend that clips SwiGLU (`Backend.clips_swiglu`: Ling-3.0-flash's late layers) is also checked
with clipping limits that bite, routed and shared (`test_clipped_parity_with_reference`; a
backend without it is skipped there, saying that a model that clips refuses it).

Backends under test: the one `--moe-backend` names (the `moe_backend` fixture). Left on `auto`,
this suite also checks `triton`, the subject of these suites, besides what `auto` resolves to on
this device (`gather` on a CPU), so the default CPU run checks the Triton kernels too.

The oracle gets the very weights the backend gets, dequantized to fp32 (bf16 -> fp32 is exact;
`moe_reference` dequantizes MXFP4 per expert, exactly), and x in fp32, so all of the difference
is the backend's own arithmetic. Tolerances, as norm-wise relative error per token row,
||out_t - ref_t|| / ||ref_t|| (a per-row bound, so one wrong token among 16 cannot hide):

- CPU, `RTOL_FP32 = 1e-5`: the interpreter path computes in fp32 like the oracle (FP32_MATH),
  only with another summation order: blocked dot products of K <= 160 terms, relative error
  around sqrt(K) * 2**-24 ~ 1e-7 (seen: 2e-7 to 4e-7). 1e-5 leaves 25x and more of margin and is
  still four orders of magnitude below what a defect does (a dropped expert or a wrong MXFP4
  scale changes rows by percents to factors).
- GPU, `RTOL_BF16 = 1e-2`: x and the weights are exact in bf16 (MXFP4 values E2M1 * 2**e are bf16
  values), products of bf16 operands are exact and accumulate in fp32 (error ~ sqrt(K) * 2**-24,
  negligible). Two roundings remain: the intermediate act = silu(x Wg) * (x Wu) is stored in
  bf16 between the two GEMMs, and the output is bf16; each rounding has relative error at most
  u = 2**-9 per element, about uniform, RMS u / sqrt(3) = 1.1e-3. The act errors are independent
  across the I terms of the down product, so they add up to a row error of norm ~1.1e-3 *
  ||out_t||; the output rounding adds the same again: sqrt(2) * 1.1e-3 = 1.6e-3 expected, and
  2 * u = 3.9e-3 if every element rounded the worst way with no cancellation. 1e-2 is 2.5x that
  and 6x the expected, and 5x below a dropped expert (one of 8 routed weights, ~5% to 20% of a row).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random

import pytest
import torch

from impl import backends
from impl.moe.reference import InputSnapshot, moe_reference
from impl.moe.shared import SharedExpert
from impl.quant.mxfp4 import MXFP4Tensor, quantize_mxfp4
from impl.routing import sigmoid_grouped_topk

RTOL_FP32 = 1e-5
RTOL_BF16 = 1e-2
ROUTED_SCALING = 2.5  # both Ling models' routed scaling factor: weights sum to 2.5 per token
TOKENS = (1, 2, 4, 16)
FORMATS = ("bf16", "mxfp4", "fp32")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared_inter: int
    n_group: int
    topk_group: int
    gpu: bool = False


SHAPES = (
    # H not a multiple of the 128-wide K block (a masked tail), I < one K block; shared I > I.
    Shape("tiny-h96", experts=8, top_k=2, hidden=96, inter=64, shared_inter=96, n_group=2, topk_group=1),
    # Full K blocks along H; I = 96 a masked tail in the down product; shared I < I.
    Shape("tiny-h128", experts=8, top_k=2, hidden=128, inter=96, shared_inter=64, n_group=1, topk_group=1),
    Shape("ling-3.0-flash", experts=512, top_k=8, hidden=2560, inter=768, shared_inter=768, n_group=8,
          topk_group=4, gpu=True),
    Shape("ling-flash-2.0", experts=256, top_k=8, hidden=4096, inter=1024, shared_inter=1024, n_group=8,
          topk_group=4, gpu=True),
)


@pytest.fixture(scope="session")
def backend(moe_checked_backend):
    """Each backend under test (the plugin parametrizes it: `--moe-backend`, plus `triton` on a CPU)."""
    return moe_checked_backend


def _block_magnitudes(shape: tuple[int, ...], g: torch.Generator, device) -> torch.Tensor:
    """A factor 2**U(-2, 2) per block of 32 along the last dim: MXFP4 blocks of one row then get
    different scales, so a scale read from the wrong block changes the result."""
    factor = torch.exp2(torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=g, device=device) * 4 - 2)
    return factor.expand(*shape[:-1], shape[-1] // 32, 32).reshape(shape)


def _routed_weight(shape: tuple[int, ...], g: torch.Generator, device) -> torch.Tensor:
    fan_in = shape[-1]
    w = torch.randn(shape, generator=g, device=device) / math.sqrt(fan_in)
    return w * _block_magnitudes(shape, g, device)


@functools.lru_cache(maxsize=1)  # cases run shape by shape and format by format
def expert_weights(shape: Shape, fmt: str, device: torch.device, seed: int):
    """(w_gate_up, w_down) of `shape` in `fmt` on `device`, built 32 experts at a time: the
    Ling shapes hold billions of elements."""
    g = torch.Generator(device).manual_seed(seed)

    def build(rows: int, cols: int):
        convert = {"bf16": lambda w: w.to(torch.bfloat16), "fp32": lambda w: w}.get(fmt, quantize_mxfp4)
        parts = [convert(_routed_weight((min(32, shape.experts - e), rows, cols), g, device))
                 for e in range(0, shape.experts, 32)]
        if fmt != "mxfp4":
            return torch.cat(parts)
        return MXFP4Tensor(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]))

    return build(2 * shape.inter, shape.hidden), build(shape.hidden, shape.inter)


@pytest.fixture(scope="module", autouse=True)
def _free_cached_weights():
    yield
    expert_weights.cache_clear()


def activation_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tolerance(device: torch.device) -> float:
    return RTOL_BF16 if device.type == "cuda" else RTOL_FP32


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Norm-wise relative error of each token row (NaN where either side is not finite)."""
    out, ref = out.double(), ref.double()
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    rel = row_errors(out, ref)
    bad = ~(rel <= tol)  # NaN counts as bad
    assert not bad.any(), (f"{what}: relative error per token row {[f'{r:.3g}' for r in rel.tolist()]} "
                           f"exceeds the tolerance {tol:g} in rows {bad.nonzero().flatten().tolist()}")


def assert_ran(prov, backend, fmt: str) -> None:
    """The backend under test ran (it, not another one, recorded kernels), in the right format."""
    events = [e for e in prov.events if e.kind == "moe"]
    assert events, (f"backend {backend.name!r} recorded no moe kernels: nothing says that it ran (a backend calls "
                    f"impl.backends.note('moe', {backend.name!r}, KERNEL_NAME) each time it runs)")
    ran = {e.backend for e in events}
    assert ran == {backend.name}, f"provenance names backends {sorted(ran)}, expected only {backend.name!r}"
    formats = {e.config["format"] for e in events if "format" in e.config}
    assert formats <= {fmt}, f"backend {backend.name!r} ran weight format(s) {sorted(formats)}, given {fmt}"


def call_backend(backend, x, weights, ids, w_gate_up, w_down, shared, **kwargs) -> torch.Tensor:
    """The backend's output and the provenance of its call; it must leave every input as it was
    (an oracle run after a backend that renormalized the weights in place would agree with it)."""
    args = dict(x=x, weights=weights, ids=ids, w_gate_up=w_gate_up, w_down=w_down, shared=shared)
    before = InputSnapshot(**args)
    with backends.record_provenance() as prov:
        try:
            out = backend.fn(x, weights, ids, w_gate_up, w_down, shared, **kwargs)
        except backends.Unsupported as e:  # a case outside what the backend covers, in its words
            pytest.skip(f"backend {backend.name!r} does not cover this case: {e}")
    changed = before.changed(**args)
    assert not changed, f"backend {backend.name!r} changed its input(s) {changed} in place"
    return out, prov


def skip_unsupported(backend, fmt: str) -> None:
    """Skip a weight format the backend does not declare (`Backend.formats`), saying so."""
    if fmt not in backend.formats:
        pytest.skip(f"backend {backend.name!r} takes {', '.join(backend.formats)} experts, not {fmt}")


def new_seed() -> int:
    fixed = os.environ.get("MOEPERF_SEED")
    return int(fixed) if fixed else random.randrange(2**31)


@functools.lru_cache(maxsize=None)
def session_seed(*key) -> int:
    """One fresh seed per key and session."""
    return new_seed()


def _shape_params():
    for shape in SHAPES:
        yield pytest.param(shape, id=shape.name, marks=[pytest.mark.gpu] if shape.gpu else [])


@dataclasses.dataclass
class Case:
    """One parity case's inputs on the device, and its description with both seeds."""
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    w_gate_up: object
    w_down: object
    shared: SharedExpert | None
    what: str


def draw_case(backend, moe_device, shape: Shape, fmt: str, tokens: int, shared_limit: float | None | bool,
              label: str) -> Case:
    """Fresh random inputs every run; the weights once per session, shape and format (the Ling
    shapes take GBs). Both seeds are in `what`; MOEPERF_SEED=N replays a run. `shared_limit`:
    False for no shared expert, else its clipping limit (None: none). Skips a format the backend
    does not take, and fp32 experts on a GPU."""
    skip_unsupported(backend, fmt)
    device = moe_device.torch_device
    if fmt == "fp32" and device.type != "cpu":
        pytest.skip("fp32 experts are the CPU model's format; a GPU model holds bf16 or MXFP4 ones")
    dtype = activation_dtype(device)
    weight_seed, seed = session_seed(shape.name, fmt), new_seed()
    w_gate_up, w_down = expert_weights(shape, fmt, device, weight_seed)
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(dtype)
    logits = torch.randn(tokens, shape.experts, generator=g, device=device) * 2
    weights, ids = sigmoid_grouped_topk(logits, shape.top_k, shape.n_group, shape.topk_group,
                                        routed_scaling_factor=ROUTED_SCALING)
    shared = None
    if shared_limit is not False:
        h, i_s = shape.hidden, shape.shared_inter
        shared = SharedExpert(*(t.to(dtype) for t in (
            torch.randn(i_s, h, generator=g, device=device) / math.sqrt(h),
            torch.randn(i_s, h, generator=g, device=device) / math.sqrt(h),
            torch.randn(h, i_s, generator=g, device=device) / math.sqrt(i_s))), limit=shared_limit)
    what = (f"{backend.name} vs moe_reference, {label}, {shape.name} {fmt} M={tokens} "
            f"(weight seed {weight_seed}, input seed {seed})")
    return Case(x, weights, ids, w_gate_up, w_down, shared, what)


@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("tokens", TOKENS, ids=[f"M{m}" for m in TOKENS])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(_shape_params()))
def test_parity_with_reference(backend, moe_device, shape, fmt, tokens, with_shared):
    c = draw_case(backend, moe_device, shape, fmt, tokens, None if with_shared else False,
                  "+shared" if with_shared else "routed only")
    out, prov = call_backend(backend, c.x, c.weights, c.ids, c.w_gate_up, c.w_down, c.shared)
    assert out.dtype == c.x.dtype, f"{c.what}: output dtype {out.dtype}, expected the activations' {c.x.dtype}"
    assert_ran(prov, backend, fmt)
    ref = moe_reference(c.x.float(), c.weights, c.ids, c.w_gate_up, c.w_down, c.shared)
    assert_rows_close(out, ref, tolerance(moe_device.torch_device), c.what)


# Clipping limits, routed and shared, of the order of the activations here (x ~ N(0, 1), weight
# rows of norm ~1 scaled by up to 4 per block): each cuts a good share of the values, so a backend
# that ignores either one misses the oracle by far more than the tolerance (checked below: leaving
# out the shared clip, the smaller effect, moved rows by 0.12 and more in 30 draws at 0.5).
CLIP_ROUTED, CLIP_SHARED = 0.75, 0.3
CLIP_TOKENS = (1, 4, 16)


@pytest.mark.parametrize("tokens", CLIP_TOKENS, ids=[f"M{m}" for m in CLIP_TOKENS])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(_shape_params()))
def test_clipped_parity_with_reference(backend, moe_device, shape, fmt, tokens):
    """SwiGLU clipped (silu(gate) capped at the limit, up clamped to +-limit) in the routed experts
    and the shared one, each at its own limit."""
    if not backend.clips_swiglu:
        pytest.skip(f"backend {backend.name!r} does not clip SwiGLU (Backend.clips_swiglu); a model that clips "
                    "refuses it")
    c = draw_case(backend, moe_device, shape, fmt, tokens, CLIP_SHARED,
                  f"clipped at {CLIP_ROUTED} / shared {CLIP_SHARED}")
    out, prov = call_backend(backend, c.x, c.weights, c.ids, c.w_gate_up, c.w_down, c.shared,
                             swiglu_limit=CLIP_ROUTED)
    assert_ran(prov, backend, fmt)

    def oracle(routed, shared):
        return moe_reference(c.x.float(), c.weights, c.ids, c.w_gate_up, c.w_down, shared, swiglu_limit=routed)
    ref = oracle(CLIP_ROUTED, c.shared)
    tol = tolerance(moe_device.torch_device)
    # The premise: leaving out either clip moves every row well past the tolerance.
    for routed, shared_limit in ((None, CLIP_SHARED), (CLIP_ROUTED, None)):
        unclipped = oracle(routed, dataclasses.replace(c.shared, limit=shared_limit))
        assert (row_errors(unclipped, ref) > 5 * tol).all(), f"{c.what}: the limits do not bite"
    assert_rows_close(out, ref, tol, c.what)
