"""What each serving engine reports of a request's speculation and of itself, read into one form.

Acceptance by one definition for every engine (impl.serve.result.Acceptance: tokens committed per
verify step, accepted drafts plus the step's own token):
* vLLM: the per-request block `metrics.speculative_decoding` on the last chunk where the server
  was started with `--per-request-spec-decode-metrics` (0.29+), else the difference of its
  `/metrics` counters around the request (at concurrency 1 that request's alone). Its mean
  acceptance length (1 + accepted / steps) is this definition.
* SGLang: per request, `meta_info` (`/generate`) or `sglext.spec_tokens_details` (OpenAI
  endpoints, with `return_spec_tokens_details`): verify steps `spec_verify_ct` and the accepted
  drafts under whichever name the version uses (`spec_num_correct_drafts`, then
  `spec_accepted_drafts`, `spec_accept_token_num`); failing those, completion tokens - 1 - steps.
  SGLang's own `spec_accept_length` is completion_tokens / verify steps, which counts the prefill
  token; it is not used.
* this project's engine over HTTP (impl.serve.http): the same block as its in-process rows.
None where the engine reports nothing: acceptance "not reported", never 0.

What a server is (`ServerInfo`): engine, version, served model, and its arguments as far as it
tells them (vLLM: `/server_info` with VLLM_SERVER_DEV_MODE=1; SGLang: `/server_info` or
`/get_server_info`; both: `/v1/models`, `/version`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from impl.serve.result import Acceptance
from moe_harness.ladder.endpoints.metrics import SpecCounters

__all__ = ["ServerInfo", "acceptance_from_block", "acceptance_from_counters", "server_info"]

ENGINES = ("vllm", "sglang", "moeperf", "openai")


@dataclass(frozen=True)
class ServerInfo:
    engine: str  # one of ENGINES ("openai": another OpenAI-compatible server)
    version: str | None
    model: str  # the served model's id (what requests name)
    root: str | None = None  # where the server loaded it from, where it says
    args: dict = field(default_factory=dict)  # the server's arguments as it reports them (speculation, backends)
    speculative: dict | None = None  # {"method", "k"} where the server says it speculates

    def key(self) -> dict:
        """What a frozen figure of this server depends on besides the row's own definition."""
        return {"engine": self.engine, "version": self.version, "model": self.model}


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ValueError(f"a count must be a non-negative integer, got {value!r}")
    return int(value)


def acceptance_from_counters(delta: SpecCounters, source: str = "vllm /metrics") -> Acceptance | None:
    """A request's acceptance from the difference of vLLM's counters around it (None: no verify
    step drafted; a server that does not speculate)."""
    if delta.drafts <= 0:
        return None
    return Acceptance(_int(delta.drafts), _int(delta.accepted),
                      tuple(_int(v) for v in delta.per_position) or None, source=source)


def _first(block: dict, *names):
    return next((block[n] for n in names if block.get(n) is not None), None)


def acceptance_from_block(extras: dict, completion_tokens: int | None) -> Acceptance | None:
    """A request's acceptance from the per-request blocks a server put in its last chunk
    (stream.Streamed.extras): vLLM's `metrics.speculative_decoding`, SGLang's `meta_info` or
    `sglext.spec_tokens_details`, this project's `metrics.speculative_decoding` (the same form as
    vLLM's, with per-position counts). None when none is there."""
    vllm = (extras.get("metrics") or {}).get("speculative_decoding")
    if isinstance(vllm, dict):
        steps = _int(vllm.get("num_spec_steps", 0))
        accepted = _int(vllm.get("num_accepted_draft_tokens", 0))
        per_position = None
        if vllm.get("accepted_per_position") is not None:
            per_position = tuple(_int(v) for v in vllm["accepted_per_position"])
        elif isinstance(vllm.get("acceptance_histogram"), list):
            # histogram[j]: steps that accepted exactly j drafts, so position i was accepted in
            # every step that accepted more than i.
            hist = [_int(v) for v in vllm["acceptance_histogram"]]
            per_position = tuple(sum(hist[i + 1:]) for i in range(len(hist) - 1))
        lengths = vllm.get("accept_lengths")
        return Acceptance(steps, accepted, per_position,
                          None if lengths is None else tuple(_int(v) for v in lengths),
                          source=vllm.get("source", "vllm per-request metrics"))
    for where, block in (("sglang sglext", (extras.get("sglext") or {}).get("spec_tokens_details")),
                         ("sglang meta_info", extras.get("meta_info"))):
        if not isinstance(block, dict) or block.get("spec_verify_ct") is None:
            continue
        steps = _int(block["spec_verify_ct"])
        accepted = _first(block, "spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
        if accepted is None:
            # Every verify step commits its accepted drafts plus one token; the first token came
            # from the prefill.
            tokens = _first(block, "completion_tokens") or completion_tokens
            if tokens is None:
                continue
            accepted = max(0, _int(tokens) - 1 - steps)
        return Acceptance(steps, _int(accepted), None, source=where)
    return None


def server_info(engine: str, models: dict, version: dict | None, info: dict | None) -> ServerInfo:
    """A server's description from its `/v1/models`, `/version` and `/server_info` answers (each
    None where the server has no such endpoint); `engine` as declared or detected."""
    data = models.get("data") if isinstance(models, dict) else None
    if not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise ValueError(f"/v1/models names no model: {str(models)[:200]}")
    model = data[0]
    info = info if isinstance(info, dict) else {}
    v = (version or {}).get("version") or info.get("version")
    args: dict = {}
    speculative = None
    if engine == "sglang":
        keys = ("model_path", "served_model_name", "quantization", "moe_runner_backend", "speculative_algorithm",
                "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "tp_size",
                "dtype")
        args = {k: info[k] for k in keys if info.get(k) is not None}
        if info.get("speculative_algorithm"):
            speculative = {"method": info["speculative_algorithm"],
                           "k": info.get("speculative_num_steps") or info.get("speculative_num_draft_tokens")}
    elif engine in ("vllm", "moeperf"):
        # vLLM: /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1) has its whole config; the
        # parts that decide what a request runs are kept.
        config = info.get("vllm_config") if engine == "vllm" else info
        spec = config.get("speculative_config") if isinstance(config, dict) else None
        if isinstance(spec, dict) and spec:
            speculative = {"method": spec.get("method"), "k": spec.get("num_speculative_tokens")}
        if isinstance(config, dict):
            model_config = config.get("model_config") if isinstance(config.get("model_config"), dict) else {}
            args = {k: v for k, v in (
                ("speculative", speculative), ("rows", config.get("rows")),
                ("dtype", model_config.get("dtype")), ("max_model_len", model_config.get("max_model_len")),
                ("quantization", model_config.get("quantization")),
                ("enforce_eager", model_config.get("enforce_eager"))) if v is not None}
            args["speculative"] = speculative  # None said outright: the server does not speculate
    return ServerInfo(engine, v, model["id"], model.get("root"), args, speculative)


def detect_engine(models: dict, version: dict | None, info: dict | None) -> str:
    """Which engine answers, from what it says of itself: `owned_by` in /v1/models ("vllm",
    "sglang", "pytest-moeperf"), else "openai"."""
    data = (models or {}).get("data") or [{}]
    owner = str(data[0].get("owned_by", "")).lower()
    if owner in ("vllm", "sglang"):
        return owner
    if owner == "pytest-moeperf":
        return "moeperf"
    if isinstance(info, dict) and "speculative_algorithm" in info:
        return "sglang"
    return "openai"
