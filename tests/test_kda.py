"""KDA (impl/model/kda.py) against transformers' BailingHybridDeltaAttention, fp32 on CPU.

The tiny config has 2 heads of 16, hidden 32, kernel 4. Weights are random but the forget gate is
set so the decay per step is small (g around -0.05..-0.3 per channel): with the checkpoint-style
init of random weights the gate sits near its -5 lower bound, the state forgets everything within a
few tokens, and an error in carrying it from prefill to decode would be invisible.
"""

from __future__ import annotations

import pytest
import torch

from impl.model import kda
from impl.model.kda import KDAAttention, KDAState, recurrent_kda_step

transformers = pytest.importorskip("transformers")
from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig  # noqa: E402
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridDeltaAttention  # noqa: E402
from tests.helpers import rel_rows  # noqa: E402

HIDDEN = 32

# Per-step bound on ||ours - reference|| / ||reference||. Both sides compute in fp32 (eps 6e-8) the
# same function with a different association: the reference runs the whole sequence in 64-token
# chunks with its own intra-chunk inverse, ours prefills in 8-token chunks with a triangular solve
# and then takes recurrent steps. Measured worst steps over 61 tokens: 1.1e-6 (safe gate), 0.9e-6
# (softplus gate), 0.5e-6 against transformers' own cache; 1e-5 leaves about a 9x margin, while a
# real fault shows far above it (not carrying the conv state from prefill to decode: 2.0).
REL_TOL = 1e-5


def tiny_config(safe_gate: bool = True) -> BailingHybridConfig:
    return BailingHybridConfig(hidden_size=HIDDEN, num_attention_heads=2, head_dim=16, short_conv_kernel_size=4,
                               num_hidden_layers=1, vocab_size=64, pad_token_id=None, eos_token_id=None,
                               kda_safe_gate=safe_gate)


def reference(safe_gate: bool = True, seed: int = 0) -> BailingHybridDeltaAttention:
    cfg = tiny_config(safe_gate)
    torch.manual_seed(seed)
    ref = BailingHybridDeltaAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
        fg = ref.forget_gate
        fg.A_log.uniform_(-1.0, 1.0)
        fg.f_proj.weight.mul_(0.3)
        # safe gate: g = -5 sigmoid(e^A (f + dt)); softplus gate: g = -e^A softplus(f + dt). dt in
        # [-6, -3] keeps both small, so the state remembers tens of tokens.
        fg.dt_bias.uniform_(-6.0, -3.0)
        ref.o_norm.weight.uniform_(0.5, 1.5)
    return ref


def ours_from(ref: BailingHybridDeltaAttention, chunk_size: int = 8) -> KDAAttention:
    m = KDAAttention.from_hf_config(ref_config(ref), chunk_size=chunk_size).eval()
    m.load_state_dict(ref.state_dict(), strict=True)
    return m


def ref_config(ref: BailingHybridDeltaAttention) -> BailingHybridConfig:
    return tiny_config(ref.forget_gate.safe_gate)


def test_parameter_names_match_transformers():
    ref = reference()
    m = KDAAttention.from_hf_config(ref_config(ref))
    assert set(m.state_dict()) == set(ref.state_dict())
    for name, p in m.state_dict().items():
        assert p.shape == ref.state_dict()[name].shape, name
    # The state is not part of the checkpoint.
    m.setup_caches(1)
    assert set(m.state_dict()) == set(ref.state_dict())


@pytest.mark.parametrize("safe_gate", [True, False])
@torch.no_grad()
def test_prefill_then_decode_matches_transformers(safe_gate):
    ref = reference(safe_gate)
    m = ours_from(ref)
    prompt, steps = 21, 40                       # 21 = two full 8-token chunks and a partial one
    torch.manual_seed(1)
    x = torch.randn(1, prompt + steps, HIDDEN)
    expected = ref(x)                            # the whole sequence, no cache
    m.setup_caches(1)
    got = [m(x[:, :prompt], input_pos=torch.arange(prompt))]
    for i in range(prompt, prompt + steps):
        got.append(m(x[:, i:i + 1], input_pos=torch.tensor([i])))
    err = rel_rows(torch.cat(got, dim=1), expected)[0]
    assert err.shape == (prompt + steps,)
    assert err.max() <= REL_TOL, f"worst step {int(err.argmax())}: {float(err.max()):.2e}"
    # The layer is not trivial: outputs differ between steps and the state is far from zero.
    assert m.state.recurrent.abs().max() > 1e-2


@torch.no_grad()
def test_stateless_call_matches_transformers():
    ref = reference(seed=3)
    m = ours_from(ref, chunk_size=16)
    torch.manual_seed(4)
    x = torch.randn(2, 37, HIDDEN)               # batch 2, three chunks, the last partial
    assert rel_rows(m(x), ref(x)).max() <= REL_TOL


@torch.no_grad()
def test_recurrent_steps_leave_the_prefill_state():
    ref = reference(seed=5)
    a, b = ours_from(ref), ours_from(ref)
    t = 29
    torch.manual_seed(6)
    x = torch.randn(1, t, HIDDEN)
    a.setup_caches(1)
    b.setup_caches(1)
    ya = a(x, input_pos=torch.arange(t))
    yb = torch.cat([b(x[:, i:i + 1], input_pos=torch.tensor([i])) for i in range(t)], dim=1)
    # Same fp32 function, chunked vs sequential association: rounding only (measured 8e-7 relative).
    assert rel_rows(ya, yb).max() <= REL_TOL
    torch.testing.assert_close(a.state.recurrent, b.state.recurrent, rtol=1e-5, atol=1e-6)
    # The conv state holds the last three projected q|k|v inputs; the projections of 29 rows and of
    # one row use different GEMM blockings, so they agree to fp32 rounding, not bit for bit.
    torch.testing.assert_close(a.state.conv, b.state.conv, rtol=1e-6, atol=1e-6)
    # And the next token sees the same state.
    nxt = torch.randn(1, 1, HIDDEN)
    assert rel_rows(a(nxt, input_pos=torch.tensor([t])), b(nxt, input_pos=torch.tensor([t]))).max() <= REL_TOL


@torch.no_grad()
def test_snapshot_detour_restore():
    ref = reference(seed=7)
    m, plain = ours_from(ref), ours_from(ref)
    torch.manual_seed(8)
    prompt, draft, accepted = torch.randn(1, 10, HIDDEN), torch.randn(1, 5, HIDDEN), torch.randn(1, 6, HIDDEN)
    for mod in (m, plain):
        mod.setup_caches(1)
        mod(prompt, input_pos=torch.arange(10))
    spare = m.new_snapshot()
    live = (m.state.recurrent.data_ptr(), m.state.conv.data_ptr())
    snap = m.state_snapshot(out=spare)
    assert snap is spare
    # The detour: five draft tokens, verified in one call and then one by one, all rejected.
    m(draft, input_pos=torch.arange(10, 15))
    for i in range(5):
        m(draft[:, i:i + 1], input_pos=torch.tensor([15 + i]))
    assert not torch.equal(m.state.recurrent, plain.state.recurrent)
    m.state_restore(snap)
    assert (m.state.recurrent.data_ptr(), m.state.conv.data_ptr()) == live   # restored in place
    # Same weights, same state, same code path: the outputs are equal bit for bit.
    for i in range(6):
        tok = accepted[:, i:i + 1]
        assert torch.equal(m(tok, input_pos=torch.tensor([10 + i])), plain(tok, input_pos=torch.tensor([10 + i])))
    assert_same_state(m, plain)


def assert_same_state(a, b) -> None:
    """Both KDA states (recurrent and short-conv) equal bit for bit."""
    assert torch.equal(a.state.recurrent, b.state.recurrent)
    assert torch.equal(a.state.conv, b.state.conv)


@torch.no_grad()
def test_advance_from_snapshot_over_accepted_tokens():
    ref = reference(seed=9)
    m, plain = ours_from(ref), ours_from(ref)
    torch.manual_seed(10)
    prompt, draft = torch.randn(1, 12, HIDDEN), torch.randn(1, 4, HIDDEN)
    for mod in (m, plain):
        mod.setup_caches(1)
        mod(prompt, input_pos=torch.arange(12))
    snap = m.state_snapshot()
    m(draft, input_pos=torch.arange(12, 16))    # verify 4 drafts; 2 accepted, the rest rejected
    y = m.advance_from(snap, draft[:, :2])
    y_plain = plain(draft[:, :2])
    assert torch.equal(y, y_plain)
    assert_same_state(m, plain)


@torch.no_grad()
def test_position_zero_starts_a_new_sequence():
    ref = reference(seed=11)
    m, fresh = ours_from(ref), ours_from(ref)
    m.setup_caches(1)
    fresh.setup_caches(1)
    torch.manual_seed(12)
    m(torch.randn(1, 9, HIDDEN), input_pos=torch.arange(9))
    x = torch.randn(1, 7, HIDDEN)
    assert torch.equal(m(x, input_pos=torch.arange(7)), fresh(x, input_pos=torch.arange(7)))
    assert torch.equal(m.state.recurrent, fresh.state.recurrent)


def test_bad_shapes_and_missing_state_raise():
    m = ours_from(reference())
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, hidden=32\]"):
        m(torch.randn(4, HIDDEN))
    with pytest.raises(ValueError, match=r"hidden=32"):
        m(torch.randn(1, 3, HIDDEN + 1))
    with pytest.raises(ValueError, match="no tokens"):
        m(torch.randn(1, 0, HIDDEN))
    with pytest.raises(ValueError, match=r"input_pos must be \[seq=3\]"):
        m(torch.randn(1, 3, HIDDEN), input_pos=torch.arange(2))
    with pytest.raises(RuntimeError, match="setup_caches"):
        m.state_snapshot()
    with pytest.raises(ValueError, match="max_batch_size"):
        m.setup_caches(0)
    m.setup_caches(1)
    with pytest.raises(ValueError, match="batch 2 exceeds the KDA state's 1"):
        m(torch.randn(2, 1, HIDDEN))
    wrong = KDAState(2, m.num_heads, m.head_dim, m.conv_dim, m.conv_kernel_size)
    with pytest.raises(ValueError, match="state shapes differ"):
        m.state_restore(wrong)
    with pytest.raises(ValueError, match="silu"):
        cfg = tiny_config()
        cfg.hidden_act = "gelu"
        KDAAttention.from_hf_config(cfg)


@torch.no_grad()
def test_decode_and_prefill_trace_as_one_graph():
    """gpt-fast style: no host syncs, no data-dependent shapes. Dynamo with fullgraph=True raises on a
    graph break (an .item(), a branch on tensor values, a shape read from data); the eager backend
    checks that without compiling kernels, so it stays fast on CPU."""
    ref = reference(seed=13)
    m, plain = ours_from(ref), ours_from(ref)
    m.setup_caches(1)
    plain.setup_caches(1)
    traced = torch.compile(m, backend="eager", fullgraph=True, dynamic=False)
    torch.manual_seed(14)
    x = torch.randn(1, 8, HIDDEN)
    pos = torch.arange(8)
    ys = [traced(x[:, :5], input_pos=pos[:5])] + [traced(x[:, i:i + 1], input_pos=pos[i:i + 1]) for i in range(5, 8)]
    ye = [plain(x[:, :5], input_pos=pos[:5])] + [plain(x[:, i:i + 1], input_pos=pos[i:i + 1]) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(ys, 1), torch.cat(ye, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.state.recurrent, plain.state.recurrent, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_decode_matches_transformers_own_cache():
    """The reference run the way transformers decodes: prefill then one token per call on its
    DynamicCache. Outputs per step and the states it keeps agree with ours (its conv state keeps
    `kernel` columns, ours the kernel - 1 that the next step reads: its last three)."""
    from transformers.cache_utils import DynamicCache

    ref = reference(seed=15)
    m = ours_from(ref)
    cache = DynamicCache(config=tiny_config())
    prompt, steps = 19, 32
    torch.manual_seed(16)
    x = torch.randn(1, prompt + steps, HIDDEN)
    m.setup_caches(1)
    expected = [ref(x[:, :prompt], cache=cache)]
    got = [m(x[:, :prompt], input_pos=torch.arange(prompt))]
    for i in range(prompt, prompt + steps):
        expected.append(ref(x[:, i:i + 1], cache=cache))
        got.append(m(x[:, i:i + 1], input_pos=torch.tensor([i])))
    err = rel_rows(torch.cat(got, 1), torch.cat(expected, 1))[0]
    assert err.max() <= REL_TOL, f"worst step {int(err.argmax())}: {float(err.max()):.2e}"
    torch.testing.assert_close(m.state.recurrent, cache.get_recurrent_state(0, state_idx=0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.state.conv, cache.get_conv_state(0, state_idx=0)[..., 1:].float(),
                               rtol=1e-6, atol=1e-6)


def _recurrence_fp64(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64: the chunked form's reference."""
    q, k, v, g, beta, s = (y.double() for y in (q, k, v, g, beta, state))
    outs = []
    for j in range(q.shape[2]):
        outs.append(recurrent_kda_step(q[:, :, j], k[:, :, j], v[:, :, j], g[:, :, j], beta[:, :, j], s))
    return torch.stack(outs, dim=2), s


@pytest.mark.parametrize("gate_low", [-50.0, -5.0, -0.05], ids=["unbounded-gate", "at-the-safe-gate-bound",
                                                           "slow-decay"])
@pytest.mark.parametrize("tokens", [7, 150, 333], ids=["inside-one-sub-block", "partial-chunk", "three-groups"])
def test_chunked_form_matches_the_recurrence_in_float64(monkeypatch, tokens, gate_low):
    """The model's 64-token chunks (four 16-token sub-blocks: the factored off-diagonal pairs and
    the exact diagonal ones), batched 128 tokens at a time so 333 tokens cross two group edges and
    end in a partial chunk. g uniform in [gate_low, 0]: at Ling's -5 bound G reaches about -160 in
    a chunk, where exp(G) alone underflows fp32 and exp(-G) overflows it; the softplus gate has no
    bound (-50: a sub-block alone spans e^-400, so only a reference point between the pair keeps
    both factors finite); the slow decay keeps
    the state's memory across every chunk and group edge. The state starts non-zero (a prefill
    continues one). Bound, relative over the whole output and the whole state: fp32 against float64;
    measured worst 1.2e-6 (outputs) and 2.3e-7 (state), as the form that solved one chunk at a
    time; 1e-5 leaves an 8x margin, while a wrong decay reference or a lost group carry is off by
    order 1. (Per token the error reaches 5e-5 of a token's own norm at the bound: the state
    forgets within a few tokens there and some outputs are small cancellations.)"""
    monkeypatch.setattr(kda, "GROUP_TOKENS", 128)
    gen = torch.Generator().manual_seed(tokens)
    b, h, d = 1, 2, 16
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rand(b, h, tokens, d), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(rand(b, h, tokens, d), dim=-1)
    v = rand(b, h, tokens, d)
    g = torch.rand(b, h, tokens, d, generator=gen) * gate_low
    beta = torch.rand(b, h, tokens, generator=gen)
    state0 = rand(b, h, d, d) * 0.5
    state = state0.clone()
    o = kda.chunked_kda(q, k, v, g, beta, state, chunk_size=64)
    o_ref, state_ref = _recurrence_fp64(q, k, v, g, beta, state0.clone())
    assert (o.double() - o_ref).norm() / o_ref.norm() <= 1e-5
    assert (state.double() - state_ref).norm() / state_ref.norm() <= 1e-5
