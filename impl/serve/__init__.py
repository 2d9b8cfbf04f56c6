"""Serving A/B on one shared model: configurations and ladders (rows.py: the spec syntax and
the per-device presets), rows built on the model and switched per request (built_row.py:
BuiltRow), the per-request serving loop with TTFT/TPOT/latency and speculative counters (engine.py: EngineRow), provenance of what ran and the
check that refuses a row that is not what it says (provenance.py), the interleaved runner
(ladder.py: Ladder) and the typed result every row produces (result.py). `python -m impl.serve`
runs a quick ladder on the embedded model."""

from impl.serve.built_row import BuiltRow, RowError, build_row, build_rows, expert_format, why_cannot_run
from impl.serve.rows import (DEFAULT_K, PRESETS, Row, ServeConfig, parse_ladder, parse_row, parse_serve_config,
                                resolve_preset)
from impl.serve.engine import EngineRow, request_seed
from impl.serve.provenance import (ProvenanceError, RowProvenance, check_provenance, provenance_problems,
                                   unshared_head_row)
from impl.serve.result import Acceptance, Failure, LadderResult, LadderStopped, RowEntry, ServedRequest
from impl.serve.ladder import Ladder, interleaved_order

__all__ = ["Acceptance", "BuiltRow", "DEFAULT_K", "EngineRow", "Failure", "Ladder", "LadderResult", "LadderStopped",
           "PRESETS", "ProvenanceError", "Row", "RowEntry", "RowError", "RowProvenance", "ServeConfig",
           "ServedRequest", "build_row", "build_rows", "check_provenance", "expert_format", "interleaved_order",
           "parse_ladder", "parse_row", "parse_serve_config", "provenance_problems", "request_seed", "resolve_preset",
           "unshared_head_row", "why_cannot_run"]
