"""Serving A/B: configurations (rows of a ladder), arms built from one shared model, a per-request
serving loop with TTFT/TPOT/latency and speculative counters, provenance of what ran, and an
interleaved runner. See configs.py for the spec syntax and the presets."""

from impl.serve.configs import (DEFAULT_K, PRESETS, Row, ServeConfig, parse_ladder, parse_row, parse_serve_config,
                                resolve_preset)

__all__ = ["DEFAULT_K", "PRESETS", "Row", "ServeConfig", "parse_ladder", "parse_row", "parse_serve_config",
           "resolve_preset"]
