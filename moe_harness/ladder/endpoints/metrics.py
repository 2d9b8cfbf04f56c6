"""A server's Prometheus counters (`/metrics`, text exposition) and vLLM's speculative-decoding
counters among them, differenced around a request (this project's engine over HTTP exports the
same counters under `moeperf:`; impl.serve.http).

vLLM counts, per engine and served model: verify steps that drafted (`num_drafts`), draft tokens
proposed, draft tokens accepted (the bonus token excluded), and accepted tokens per draft position;
each a counter whose samples end in `_total` (prometheus_client adds `_created` gauges beside
them, which are not counts). Samples are summed over their engines, as `vllm bench serve` sums
them. At concurrency 1 the difference around one request is that request's acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["SpecCounters", "parse_samples", "requests_running", "vllm_spec_counters"]

PREFIXES = ("vllm:", "moeperf:")  # vLLM's names, and the same counters of this project's engine
SPEC = "spec_decode_"


def parse_samples(text: str) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of every sample in a Prometheus text exposition; ValueError
    naming the problem for text that is not one."""
    try:
        return [(s.name, dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
                for s in family.samples]
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"not a Prometheus text exposition: {e}") from None


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counts: verify steps that drafted, drafts proposed, drafts accepted,
    and drafts accepted at each position 0..k-1."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...]

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        k = max(len(self.per_position), len(before.per_position))
        pad = lambda t: tuple(t) + (0.0,) * (k - len(t))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.per_position), pad(before.per_position))))


def vllm_spec_counters(text: str) -> SpecCounters | None:
    """vLLM's speculative-decoding counters in a `/metrics` text, summed over engines; None where
    the server exports none of them (it does not speculate, or is not vLLM)."""
    sums = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    positions: dict[int, float] = {}
    seen = False
    for name, labels, value in parse_samples(text):
        prefix = next((p + SPEC for p in PREFIXES if name.startswith(p + SPEC)), None)
        if prefix is None or not name.endswith("_total"):
            continue
        seen = True
        key = name[len(prefix):-len("_total")]
        if key == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", "-1"))
            if pos < 0:
                raise ValueError(f"{name} without a position label: {labels}")
            positions[pos] = positions.get(pos, 0.0) + value
        elif key in sums:
            sums[key] += value
    if not seen:
        return None
    k = max(positions, default=-1) + 1
    return SpecCounters(sums["num_drafts"], sums["num_draft_tokens"], sums["num_accepted_tokens"],
                        tuple(positions.get(j, 0.0) for j in range(k)))


def requests_running(text: str) -> float | None:
    """Requests a vLLM-style server is running now (`num_requests_running`, summed over engines);
    None where it does not say."""
    values = [v for name, _, v in parse_samples(text) if name in (p + "num_requests_running" for p in PREFIXES)]
    return sum(values) if values else None
