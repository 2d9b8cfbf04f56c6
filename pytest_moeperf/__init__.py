"""pytest-moeperf: prove that a faster MoE decode configuration computes the same thing and is faster.

The pytest plugin (`pytest_moeperf.plugin`, loaded through the pytest11 entry point) gives
device, model and frozen-baseline fixtures and a noise-aware gate; `impl` is the reference
implementation the suites check.
"""

from pytest_moeperf.baselines import BaselineError, BaselineStore, FrozenMetric
from pytest_moeperf.gate import Gate, GateResult, HostContendedWarning, RefreezeWarning
from pytest_moeperf.stats import Comparison, compare

__version__ = "0.1.0"
__all__ = ["BaselineError", "BaselineStore", "Comparison", "FrozenMetric", "Gate", "GateResult",
           "HostContendedWarning", "RefreezeWarning", "compare"]
