"""impl.model.kda_decode (one KDA decode token as one Triton kernel) against the torch step of
impl.model.kda, which test_kda.py holds to transformers: on CPU through Triton's interpreter, on a
GPU through the module's own dispatch. fp32, fresh random weights and states (never zeros), the
forget gate set to remember tens of tokens.

Tolerance 5e-5 relative (the output, the state, the convolution inputs): both compute the same
fp32 terms in another order (the kernel's sums over 32-128 channels in registers against einsum);
measured 2e-7 on one CPU's interpreter and 1.3e-5 on another's (the output one token after a
reset; against the module run in float64 the kernel there is 1.1e-5 off, the torch step 2.9e-6).
A planted fault (no state decay, a shifted conv window) is orders of magnitude off.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.layer_backends import set_layer_backend
from impl.model.kda import KDAAttention
from impl.model.kda_decode import kda_decode
from tests.helpers import rel_err

REL = 5e-5
# The kernel runs where the tensors are: compiled on a GPU, interpreted on a CPU-only machine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def module(hidden=64, heads=2, dim=32, safe_gate=True, seed=0, device=DEVICE) -> KDAAttention:
    torch.manual_seed(seed)
    m = KDAAttention(hidden, heads, dim, safe_gate=safe_gate).to(device).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.forget_gate.A_log.uniform_(-1, 1)
        m.forget_gate.dt_bias.uniform_(-6, -3)
        m.o_norm.weight.uniform_(0.5, 1.5)
    set_layer_backend(m, "attention", "torch")  # the module's own torch step is the reference here
    return m


def kernel_step(m: KDAAttention, x: torch.Tensor, state, conv, keep: float):
    xx = x[:, 0]
    return m.o_proj(kda_decode(
        torch.cat([m.q_proj(xx), m.k_proj(xx), m.v_proj(xx)], -1), m.forget_gate.f_proj(xx), m.b_proj(xx),
        m.g_proj(xx), conv, m.conv1d.weight.view(m.conv_dim, m.conv_kernel_size), m.forget_gate.dt_bias,
        m.forget_gate.A_log, m.o_norm.weight, state, state, torch.tensor([keep], device=x.device), m.num_heads,
        m.forget_gate.safe_gate, m.forget_gate.lower_bound, m.o_norm.eps))[:, None]


@pytest.mark.parametrize("safe_gate", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_kernel_steps_equal_the_torch_steps(safe_gate, batch):
    m = module(safe_gate=safe_gate)
    m.setup_cache(batch)
    g = torch.Generator(DEVICE).manual_seed(1)
    with torch.inference_mode():
        m(torch.randn(batch, 7, 64, generator=g, device=DEVICE), input_pos=torch.arange(7, device=DEVICE))
        state, conv = m.state.recurrent.clone(), m.state.conv.clone()  # a non-zero state
        for t in range(7, 12):
            x = torch.randn(batch, 1, 64, generator=g, device=DEVICE)
            want = m(x, input_pos=torch.tensor([t], device=DEVICE))
            got = kernel_step(m, x, state, conv, keep=1.0)
            assert rel_err(got, want) <= REL and rel_err(state, m.state.recurrent) <= REL
            assert rel_err(conv, m.state.conv) <= REL


def test_keep_zero_starts_a_new_sequence():
    m = module()
    m.setup_cache(1)
    g = torch.Generator(DEVICE).manual_seed(2)
    with torch.inference_mode():
        m(torch.randn(1, 5, 64, generator=g, device=DEVICE), input_pos=torch.arange(5, device=DEVICE))
        state, conv = m.state.recurrent.clone(), m.state.conv.clone()
        x = torch.randn(1, 1, 64, generator=g, device=DEVICE)
        want = m(x, input_pos=torch.tensor([0], device=DEVICE))  # position 0: the stored state is forgotten
        got = kernel_step(m, x, state, conv, keep=0.0)
    assert rel_err(got, want) <= REL and rel_err(state, m.state.recurrent) <= REL


def test_a_planted_fault_is_caught():
    """Negative control: the kernel run with the decay switched off (A_log at -30, so g ~ 0 and
    exp(g) ~ 1) against the torch step with it is far outside the tolerance."""
    m = module()
    m.setup_cache(1)
    with torch.inference_mode():
        m(torch.randn(1, 6, 64, device=DEVICE), input_pos=torch.arange(6, device=DEVICE))
        state, conv = m.state.recurrent.clone(), m.state.conv.clone()
        x = torch.randn(1, 1, 64, device=DEVICE)
        want = m(x, input_pos=torch.tensor([6], device=DEVICE))
        with torch.no_grad():
            m.forget_gate.A_log.fill_(-30.0)  # rate ~ 1e-13: g ~ 0 for the kernel's step only
        got = kernel_step(m, x, state, conv, keep=1.0)
    assert rel_err(got, want) > 100 * REL


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_dispatch_on_the_device(dtype, tokens):
    """On CUDA a one-token call, and a verify pass of four, take the kernel (with the fused
    projections); the torch step with the same weights and state agrees (bf16: 2e-2, the
    activations' rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m = module(hidden=256, heads=2, dim=128, device="cuda").to(dtype)
    m.conv1d.float()  # what build_model keeps in fp32
    m.forget_gate.A_log.data = m.forget_gate.A_log.data.float()
    m.forget_gate.dt_bias.data = m.forget_gate.dt_bias.data.float()
    m.fuse_projections()
    m.setup_cache(1, verify_tokens=4)
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.inference_mode():
        m(torch.randn(1, 9, 256, device="cuda", generator=g).to(dtype), input_pos=torch.arange(9, device="cuda"))
        snap = m.state_snapshot()
        x = torch.randn(1, tokens, 256, device="cuda", generator=g).to(dtype)
        pos = torch.arange(9, 9 + tokens, device="cuda")
        set_layer_backend(m, "attention", "triton")
        got = m(x, input_pos=pos)
        after = m.state_snapshot()
        m.state_restore(snap)
        set_layer_backend(m, "attention", "torch")
        want = m(x, input_pos=pos)
    tol = REL if dtype == torch.float32 else 2e-2
    err, state_err = rel_err(got.float(), want.float()), rel_err(after.recurrent, m.state.recurrent)
    assert err <= tol and state_err <= tol, (err, state_err)


def test_a_head_dim_the_tiles_cannot_hold_is_refused():
    h, d = 2, 24
    z = lambda *s: torch.zeros(*s)  # noqa: E731  (shapes only: the check comes first)
    with pytest.raises(ValueError, match="head_dim 24 must be a power of two"):
        kda_decode(z(1, 3 * h * d), z(1, h * d), z(1, h), z(1, h * d), z(1, 3 * h * d, 3), z(3 * h * d, 4),
                   z(h * d), z(h), z(d), z(1, h, d, d), z(1, h, d, d), torch.ones(1), h, True, -5.0, 1e-6)


def test_only_a_decode_token_lets_o_proj_start_before_the_output_kernel_waits(monkeypatch):
    """`release_early` (the output kernel releases the next launch before its wait) is asked for a
    decode token, whose next launch is o_proj's GEMV (weights only before its wait), and never in
    a verify pass, where the next token's first kernel reads the state this token writes."""
    from impl.model import kda_decode as kd
    asked, original = [], kd.kda_decode

    def recording(*args, release_early=False, **kwargs):
        asked.append(release_early)
        return original(*args, release_early=release_early, **kwargs)

    monkeypatch.setattr(kd, "kda_decode", recording)
    m = module(seed=4)
    m.setup_cache(1, verify_tokens=4)
    g = torch.Generator(DEVICE).manual_seed(6)
    with torch.inference_mode():
        m._decode_kernel(torch.randn(1, 1, 64, generator=g, device=DEVICE), torch.tensor([3], device=DEVICE))
        m._verify_kernel(torch.randn(1, 4, 64, generator=g, device=DEVICE), torch.arange(4, 8, device=DEVICE))
    assert asked == [True, False, False, False, False]


@pytest.mark.parametrize("tokens,count", [(4, 1), (4, 3), (2, 2)])
def test_a_verify_pass_through_the_kernel_equals_the_torch_pass(tokens, count):
    """A verify pass of T tokens token by token through the kernel (`_verify_kernel`, what CUDA
    dispatches) against the torch pass: outputs, the live state after it, and the state
    keep_verified(count) leaves (the track's states and window)."""
    m = module(seed=4)
    m.setup_cache(1, verify_tokens=4)
    g = torch.Generator(DEVICE).manual_seed(5)
    with torch.inference_mode():
        m(torch.randn(1, 7, 64, generator=g, device=DEVICE), input_pos=torch.arange(7, device=DEVICE))
        snap = m.state_snapshot()
        x = torch.randn(1, tokens, 64, generator=g, device=DEVICE)
        pos = torch.arange(7, 7 + tokens, device=DEVICE)
        want = m(x, input_pos=pos)
        want_live = m.state_snapshot()
        m.keep_verified(torch.tensor([count], device=DEVICE))
        want_kept = m.state_snapshot()
        m.state_restore(snap)
        got = m._verify_kernel(x, pos)
        got_live = m.state_snapshot()
        m.keep_verified(torch.tensor([count], device=DEVICE))
    assert rel_err(got, want) <= REL and rel_err(got_live.recurrent, want_live.recurrent) <= REL
    assert rel_err(m.state.recurrent, want_kept.recurrent) <= REL and rel_err(m.state.conv, want_kept.conv) <= REL
    # Negative control: keeping another count than the torch pass kept is far off.
    other = 1 if count != 1 else tokens
    m.keep_verified(torch.tensor([other], device=DEVICE))
    assert rel_err(m.state.recurrent, want_kept.recurrent) > 100 * REL
