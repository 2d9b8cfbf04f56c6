"""Speculative decoding with the model's MTP (NEXTN) layer as the draft."""

from impl.speculative.decoder import (HeadSharingError, Span, SpecResult, SpecState, SpecStats, SpeculativeDecoder,
                               check_head_sharing)
from impl.speculative.sampling import MAX_K, greedy_verify, ratio_rule, rejection_verify

__all__ = ["HeadSharingError", "MAX_K", "Span", "SpecResult", "SpecState",
           "SpecStats", "SpeculativeDecoder", "check_head_sharing",
           "greedy_verify", "ratio_rule", "rejection_verify"]
