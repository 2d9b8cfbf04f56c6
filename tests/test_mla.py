"""impl.model.mla against transformers' BailingHybridAttention (Ling 3.0's MLA), in fp32 on CPU
with a tiny random config.

Tolerance: relative error (Frobenius norm of the difference over the reference's norm) <= 1e-5
per step. fp32's unit roundoff is 6e-8; the two implementations differ only in the order of
their reductions (the absorbed form computes (W_uk^T q_nope) . c where the reference computes
q_nope . (W_uk c), and different matmul / softmax kernels), which at these sizes (reductions of
at most 64 terms, 45 keys) measures ~1e-6 or less. 1e-5 leaves that margin while any modelling
mistake (rope layout, softmax scale, gate, norm eps) gives errors of 1e-3 and more; the
negative controls below show the bound separates the two.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers.models.bailing_hybrid")
from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig  # noqa: E402
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (  # noqa: E402
    BailingHybridAttention, BailingHybridRotaryEmbedding)

from impl.model import mla as mla_mod  # noqa: E402
from impl.model.layers import apply_rope  # noqa: E402
from impl.model.mla import MLAAttention, MLACache, MLAConfig, mla_rope_tables  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

HIDDEN, CACHE_LEN, PROMPT, DECODE_STEPS = 64, 64, 9, 36
RTOL = 1e-5


def tiny_config(q_lora_rank=None, **overrides) -> BailingHybridConfig:
    # rms_norm_eps is deliberately large: the reference's latent norms use 1e-6 whatever the
    # config says, so an implementation that took config.rms_norm_eps would be off by ~1e-3.
    kw = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=q_lora_rank,
              rope_theta=10000.0, rms_norm_eps=1e-2, num_hidden_layers=1, vocab_size=32,
              pad_token_id=None, eos_token_id=None)
    kw.update(overrides)
    cfg = BailingHybridConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def make_pair(seed: int, q_lora_rank=None):
    """(reference attention, ours with the reference's state_dict loaded, hf config)."""
    cfg = tiny_config(q_lora_rank)
    g = torch.Generator().manual_seed(seed)
    ref = BailingHybridAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "layernorm" in name:  # norm weights near 1, not all equal to it
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    ours = MLAAttention.from_hf_config(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours, cfg


def reference_full(ref, cfg, x: torch.Tensor) -> torch.Tensor:
    """The reference over the whole sequence at once, causal (additive -inf above the diagonal)."""
    n = x.shape[1]
    cos_sin = BailingHybridRotaryEmbedding(cfg)(x, torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return ref(x, cos_sin, mask)[0]


class Runner:
    """Prefill / decode through our module with its static cache, as a serving loop calls it."""

    def __init__(self, module: MLAAttention, cache_len: int = CACHE_LEN) -> None:
        self.m = module
        module.setup_cache(1, cache_len)
        self.cos, self.sin = mla_rope_tables(module.config, cache_len)
        self.causal = torch.tril(torch.ones(cache_len, cache_len, dtype=torch.bool))

    def step(self, x: torch.Tensor, start: int, absorb=None) -> torch.Tensor:
        pos = torch.arange(start, start + x.shape[1])
        with torch.no_grad():
            return self.m(x, self.cos[pos], self.sin[pos], pos, self.causal[pos], absorb=absorb)


def seq(seed: int, n: int) -> torch.Tensor:
    return torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["no-q-lora(Ling-3.0-flash)", "q-lora"])
def test_prefill_then_decode_matches_reference(q_lora_rank):
    ref, ours, cfg = make_pair(seed=1, q_lora_rank=q_lora_rank)
    x = seq(2, PROMPT + DECODE_STEPS)
    want = reference_full(ref, cfg, x)
    run = Runner(ours)
    errs = [rel_err(run.step(x[:, :PROMPT], 0), want[:, :PROMPT])]  # prefill: expanded form by default
    for i in range(PROMPT, PROMPT + DECODE_STEPS):               # decode: absorbed form by default
        errs.append(rel_err(run.step(x[:, i:i + 1], i), want[:, i:i + 1]))
    assert len(errs) == 1 + DECODE_STEPS >= 33
    assert max(errs) <= RTOL, [f"{e:.2e}" for e in errs]


def test_bound_rejects_modelling_mistakes(monkeypatch):
    """Negative controls: each mistake, put in on purpose, breaks the 1e-5 bound by far."""
    ref, ours, cfg = make_pair(seed=3)
    x = seq(4, PROMPT + 4)
    want = reference_full(ref, cfg, x)

    def worst() -> float:
        run = Runner(ours)
        e = [rel_err(run.step(x[:, :PROMPT], 0), want[:, :PROMPT])]
        e += [rel_err(run.step(x[:, i:i + 1], i), want[:, i:i + 1]) for i in range(PROMPT, x.shape[1])]
        return max(e)

    assert worst() <= RTOL
    with monkeypatch.context() as mp:  # rotate-half pairs (i, i + d/2) instead of interleaved ones
        mp.setattr(mla_mod, "apply_interleaved_rope", apply_rope)
        assert worst() > 100 * RTOL
    with monkeypatch.context() as mp:  # the config's norm eps (1e-2 here) instead of 1e-6
        for norm in (ours.kv_a_layernorm,):
            mp.setattr(norm, "eps", cfg.rms_norm_eps)
        assert worst() > 100 * RTOL
    with monkeypatch.context() as mp:  # the gate ignores its input (sigmoid(0) = 0.5 for every head)
        mp.setattr(ours.g_proj.weight, "data", torch.zeros_like(ours.g_proj.weight))
        assert worst() > 100 * RTOL
    with monkeypatch.context() as mp:  # softmax scale over the absorbed dim (r + dr) instead of dn + dr
        mp.setattr(MLAConfig, "scaling", property(lambda c: (c.kv_lora_rank + c.qk_rope_head_dim) ** -0.5))
        assert worst() > 100 * RTOL
    assert worst() <= RTOL


def test_absorbed_decode_equals_expanded():
    _, ours, _ = make_pair(seed=5)
    x = seq(6, PROMPT + DECODE_STEPS)
    run = Runner(ours)
    a, e = run.step(x[:, :PROMPT], 0, absorb=True), run.step(x[:, :PROMPT], 0, absorb=False)
    assert rel_err(a, e) <= RTOL  # prefill in either form
    for i in range(PROMPT, PROMPT + DECODE_STEPS):
        # Both calls write the same cache row at position i, so the second sees the same state.
        a = run.step(x[:, i:i + 1], i, absorb=True)
        e = run.step(x[:, i:i + 1], i, absorb=False)
        assert rel_err(a, e) <= RTOL, i

    # Default dispatch: a one-token call takes the absorbed form (never expands the cache), a
    # prompt longer than absorb_max_tokens the expanded one.
    calls = []
    for form in ("_absorbed", "_expanded"):
        orig = getattr(ours, form)
        setattr(ours, form, lambda *a, _o=orig, _f=form: calls.append(_f) or _o(*a))
    Runner(ours).step(x[:, :ours.absorb_max_tokens + 1], 0)
    run = Runner(ours)
    run.step(x[:, :1], 0)
    assert calls == ["_expanded", "_absorbed"]


def test_cache_bytes_per_token():
    _, ours, _ = make_pair(seed=7)
    c = ours.config
    for dtype in (torch.float32, torch.bfloat16):
        cache = ours.setup_cache(1, CACHE_LEN, dtype=dtype)
        per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()
        assert cache.bytes_per_token == per_token
        # Everything the module holds that grows with the sequence is this one buffer.
        held = sum(b.numel() * b.element_size() for b in ours.buffers())
        assert held == CACHE_LEN * per_token
        assert not ours.state_dict().keys() & {"kv_cache.kv"}  # non-persistent: not in checkpoints

    # Ling-3.0-flash's dims (the config's defaults), built on the meta device: 512 + 64 values a
    # token, 1152 bytes in bf16, against 32 heads x (192 + 128) x 2 = 20480 for expanded K/V.
    flash = BailingHybridConfig(pad_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        m = MLAAttention.from_hf_config(flash)
    cache = m.setup_cache(1, 4096, dtype=torch.bfloat16)
    assert cache.kv.shape[-1] == 576 and cache.bytes_per_token == 1152


def test_decode_has_no_host_sync_and_static_shapes():
    """A decode step runs on the meta device, where tensors have no data: any host read of a
    value (.item(), a Python branch on a tensor, a data-dependent shape) would raise."""
    cfg = tiny_config()
    with torch.device("meta"):
        m = MLAAttention.from_hf_config(cfg)
        m.setup_cache(1, CACHE_LEN)
        cos = sin = torch.empty(1, cfg.qk_rope_head_dim)
        x = torch.empty(1, 1, HIDDEN)
        pos = torch.empty(1, dtype=torch.long)
        mask = torch.empty(1, CACHE_LEN, dtype=torch.bool)
        for absorb in (None, True, False):
            assert m(x, cos, sin, pos, mask, absorb=absorb).shape == (1, 1, HIDDEN)


def test_overwrite_after_rejection_equals_fresh_run():
    ref, ours, cfg = make_pair(seed=8)
    fresh = copy.deepcopy(ours)
    accepted, drafted = 2, 5
    truth = seq(9, PROMPT + 4 + accepted + 10)  # prompt, 4 decoded, 2 accepted drafts, 10 more
    drafts = torch.cat((truth[:, PROMPT + 4:PROMPT + 4 + accepted], seq(10, drafted - accepted)), dim=1)
    first_rejected = PROMPT + 4 + accepted

    run = Runner(ours)
    run.step(truth[:, :PROMPT], 0)
    for i in range(PROMPT, PROMPT + 4):
        run.step(truth[:, i:i + 1], i)
    verify = run.step(drafts, PROMPT + 4)  # one verification call over 5 draft tokens (absorbed)
    # The rejected drafts' rows are in the cache now, at the positions the true tokens will take.
    stale = ours.kv_cache.kv[0, first_rejected].clone()
    # Rollback is nothing but continuing at the first rejected position: its row gets overwritten,
    # and rows past the current position are masked out until they are.
    spec_out = [run.step(truth[:, i:i + 1], i) for i in range(first_rejected, truth.shape[1])]
    assert not torch.equal(ours.kv_cache.kv[0, first_rejected], stale)

    frun = Runner(fresh)
    frun.step(truth[:, :PROMPT], 0)
    fresh_out = [frun.step(truth[:, i:i + 1], i) for i in range(PROMPT, truth.shape[1])]
    fresh_after = fresh_out[first_rejected - PROMPT:]
    for a, b in zip(spec_out, fresh_after):
        assert rel_err(a, b) <= RTOL
    n = truth.shape[1]
    torch.testing.assert_close(ours.kv_cache.kv[:, :n], fresh.kv_cache.kv[:, :n], rtol=RTOL, atol=1e-6)

    # The accepted drafts' outputs from the verification call equal the fresh run's decode steps
    # at those positions, and both runs equal the reference over the true sequence.
    for j in range(accepted):
        assert rel_err(verify[:, j:j + 1], fresh_out[4 + j]) <= RTOL
    want = reference_full(ref, cfg, truth)
    for k, i in enumerate(range(first_rejected, n)):
        assert rel_err(spec_out[k], want[:, i:i + 1]) <= RTOL


def test_bad_shapes_raise_clear_errors():
    _, ours, cfg = make_pair(seed=11)
    c = ours.config
    cos, sin = mla_rope_tables(c, CACHE_LEN)
    x = seq(12, 3)
    pos = torch.arange(3)
    causal = torch.tril(torch.ones(CACHE_LEN, CACHE_LEN, dtype=torch.bool))

    with pytest.raises(ValueError, match="input_pos and mask are for a cached call"):
        ours(x, cos[pos], sin[pos], pos, causal[pos])
    ours.setup_cache(1, CACHE_LEN)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, hidden=64\]"):
        ours(x[0], cos[pos], sin[pos], pos, causal[pos])
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, hidden=64\]"):
        ours(x[..., :32], cos[pos], sin[pos], pos, causal[pos])
    with pytest.raises(ValueError, match=r"cos must be \[seq=3, qk_rope_head_dim=8\]"):
        ours(x, cos[:2], sin[pos], pos, causal[pos])
    with pytest.raises(ValueError, match=r"sin must be \[seq=3, qk_rope_head_dim=8\]"):
        ours(x, cos[pos], torch.cat((sin[pos], sin[pos]), -1), pos, causal[pos])
    with pytest.raises(ValueError, match=r"input_pos must be an integer tensor \[seq=3\]"):
        ours(x, cos[pos], sin[pos], None, causal[pos])
    with pytest.raises(ValueError, match=r"input_pos must be an integer tensor \[seq=3\]"):
        ours(x, cos[pos], sin[pos], pos[:2], causal[pos])
    with pytest.raises(ValueError, match=r"input_pos must be an integer tensor \[seq=3\]"):
        ours(x, cos[pos], sin[pos], pos.float(), causal[pos])
    with pytest.raises(ValueError, match=r"mask must end in \[seq=3, cache_len=64\]"):
        ours(x, cos[pos], sin[pos], pos, causal[pos][:, :10])
    with pytest.raises(ValueError, match="batch 2 exceeds the cache's batch 1"):
        ours(x.expand(2, -1, -1), cos[pos], sin[pos], pos, causal[pos])

    with pytest.raises(ValueError, match="num_key_value_heads == num_attention_heads"):
        MLAConfig.from_hf(tiny_config(num_key_value_heads=2))
    with pytest.raises(NotImplementedError, match="default rope only"):
        MLAConfig.from_hf(tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(hidden_size=8, num_heads=1, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=3,
                  v_head_dim=4)
    with pytest.raises(ValueError, match="cache batch and max_seq_len must be >= 1"):
        MLACache(1, 0, 4, 2, torch.float32, "cpu")
    # A checkpoint for other dims does not load silently.
    other = BailingHybridAttention(tiny_config(kv_lora_rank=16), layer_idx=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ours.load_state_dict(other.state_dict())
