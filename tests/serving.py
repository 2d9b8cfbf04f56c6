"""Serving an arm in the tests: one impl.serve.engine.EngineRow per arm, kept while the arm lives,
so its captured steps and provenance carry over from request to request as in a ladder."""

from __future__ import annotations

import weakref

from impl.serve.engine import EngineRow

_rows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_row(arm) -> EngineRow:
    row = _rows.get(arm)
    if row is None:
        row = _rows[arm] = EngineRow(arm)
    return row


def serve(arm, request):
    """What `arm` serves for `request` (impl.serve.result.ServedRequest)."""
    return engine_row(arm).serve(request)
