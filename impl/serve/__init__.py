"""Serving A/B on one shared model: configurations and ladders (rows.py: the spec syntax and
the per-device presets; defaults.py: the default ladder and request counts), rows built on the
model and switched per request (built_row.py: BuiltRow), the per-request serving loop with
TTFT/TPOT/latency and speculative counters (engine.py: EngineRow), provenance of what ran and the
check that refuses a row that is not what it says (provenance.py), the interleaved runner
(ladder.py: Ladder) and the typed result every row produces (result.py). `python -m impl.serve`
runs a quick ladder on the embedded model.

The names below are loaded on first use (PEP 562), so importing one torch-free module of this
package (defaults.py, result.py) does not import torch and the model code."""

from impl.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "built_row": ("BuiltRow", "RowError", "build_row", "build_rows", "expert_format", "why_cannot_run"),
    "rows": ("DEFAULT_K", "PRESETS", "Row", "ServeConfig", "parse_ladder", "parse_row", "parse_serve_config",
             "resolve_preset"),
    "engine": ("EngineRow", "request_seed"),
    "provenance": ("ProvenanceError", "RowProvenance", "check_provenance", "provenance_problems",
                   "unshared_head_row"),
    "result": ("Acceptance", "Failure", "LadderResult", "LadderStopped", "RowEntry", "ServedRequest"),
    "ladder": ("Ladder", "interleaved_order"),
})
