"""The streaming-ceiling probe's kernels (scripts/gpu/probe_stream.py) read exactly the bytes they
claim to: every config's int32 sum equals torch's over the chosen experts' rows and the shared
matrix (interpreter on CPU), repeated ids included. A probe that skipped rows or read the wrong
expert would report a ceiling for fewer bytes than the layer reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import impl.triton_env  # noqa: F401  (the interpreter is on before the script's kernels are defined)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import probe_stream  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; the GPU run checks itself")


@pytest.fixture
def cpu_probe(monkeypatch):
    monkeypatch.setattr(probe_stream, "DEV", torch.device("cpu"))
    monkeypatch.setattr(probe_stream, "_sm_count", lambda: 3)


def _sum(out: torch.Tensor) -> int:
    return (int(out.long().sum()) + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize("layout, config", [("rows", probe_stream.ROWS_CONFIGS[0]),
                                            ("rows", dict(BLOCK_R=32, BLOCK_K=256, warps=4, STAGES=3)),
                                            ("flat", probe_stream.FLAT_CONFIGS[0]),
                                            ("flat", dict(BLOCK=1024, warps=4, STAGES=3, waves=4))])
def test_stream_kernels_read_every_word_once(cpu_probe, layout, config):
    # rows of 1360 bytes (Ling-3.0-flash's MXFP4 gate_up) and of 408 (padded to 416), shared rows in bf16
    for phase in (probe_stream.Phase("gate_up", 6, 40, 1360, 24, 512), probe_stream.Phase("down", 5, 33, 408, 9, 96)):
        ids = torch.tensor([[3, 1, 4, 3]], dtype=torch.int32)
        out = phase.launcher(layout, config, 4, pdl=False)(ids)
        assert _sum(out) == phase.reference(ids, 4)
        # the control: another expert's bytes give another sum
        assert phase.reference(torch.tensor([[3, 1, 2, 3]], dtype=torch.int32), 4) != _sum(out)


def test_router_phase_reads_the_dense_matrix_only(cpu_probe):
    router = probe_stream.Phase("router", 1, 1, 4, 40, 4 * 64)
    ids = torch.zeros(1, dtype=torch.int32)
    for layout, config in (("rows", probe_stream.ROWS_CONFIGS[0]), ("flat", probe_stream.FLAT_CONFIGS[0])):
        out = router.launcher(layout, config, 0, pdl=False)(ids)
        assert _sum(out) == router.reference(ids, 0) == _sum(router.shared)
