"""The Ling LM heads the FP8 head is measured at, and the speed it was built to reach there on an
NVIDIA H200: suites/test_head_bench.py asserts the targets, scripts/gpu/bench_head.py reports
its contenders against them.
"""

from __future__ import annotations

LING_HEADS = {"ling-3.0-flash": (157184, 2560), "ling-flash-2.0": (157184, 4096)}  # vocab x hidden

# Targets on the H200, M=1 medians under CUDA graphs: the FP8 head within these times (its peer,
# torch._scaled_mm with per-tensor scales, takes 103 and 160 us there; the FP8 byte floors are 94
# and 151 us), at 90% or more of its byte floor at hidden 2560, and at M=4 within 1.15x of M=1.
# notes/head-h200.md has them met: 97.2 and 150.5 us, M=4 1.02x and 1.01x.
H200_BARS_US = {"ling-3.0-flash": 110.0, "ling-flash-2.0": 165.0}
H200_MIN_FLOOR_FRACTION = {"ling-3.0-flash": 0.90}
H200_MAX_M4_OVER_M1 = 1.15
