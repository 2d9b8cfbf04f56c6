"""Serving A/B on one shared model: configurations and ladders (configs.py: the spec syntax and
the per-device presets), arms switched per request (arm.py), the per-request serving loop with
TTFT/TPOT/latency and speculative counters (engine.py), provenance of what ran and the check that
refuses a row that is not what it says (provenance.py), and the interleaved runner (runner.py).
`python -m impl.serve` runs a quick ladder on the embedded model."""

from impl.serve.arm import Arm, ArmError, build_arm, build_arms, expert_format, why_cannot_run
from impl.serve.configs import (DEFAULT_K, PRESETS, Row, ServeConfig, parse_ladder, parse_row, parse_serve_config,
                                resolve_preset)
from impl.serve.engine import RECORD_KEYS, prepare, request_seed, run_request
from impl.serve.provenance import (ProvenanceError, RowProvenance, check_provenance, provenance_problems,
                                   unshared_head_arm)
from impl.serve.runner import interleaved_order, iter_ladder, run_ladder, where_failed

__all__ = ["Arm", "ArmError", "DEFAULT_K", "PRESETS", "ProvenanceError", "RECORD_KEYS", "Row", "RowProvenance",
           "ServeConfig", "build_arm", "build_arms", "check_provenance", "expert_format", "interleaved_order",
           "iter_ladder", "parse_ladder", "parse_row", "parse_serve_config", "prepare", "provenance_problems",
           "request_seed", "resolve_preset", "run_ladder", "run_request", "unshared_head_arm", "where_failed",
           "why_cannot_run"]
