"""Speculative decoding with the model's MTP (NEXTN) layer as the draft."""

from impl.spec.decoder import HeadSharingError, SpecResult, SpecStats, SpeculativeDecoder, check_head_sharing
from impl.spec.sampling import MAX_K, greedy_verify, ratio_rule, rejection_verify

__all__ = ["HeadSharingError", "MAX_K", "SpecResult", "SpecStats", "SpeculativeDecoder", "check_head_sharing",
           "greedy_verify", "ratio_rule", "rejection_verify"]
