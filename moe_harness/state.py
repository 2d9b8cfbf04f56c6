"""The MoE harness's run state: its options, the gate core's session beside them, what follows from
both (the backend under test, the dtype, the checkpoint's digest), and the lines the A/B ladder
leaves for the run's summary. Kept in pytest's config stash under HARNESS_KEY."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import pytest

from moe_harness.options import MoeOptions


def moe_backend_under_test(backend: str, is_cuda: bool) -> str:
    """The MoE backend under test for --moe-backend `backend`: `auto` is Triton on a GPU and gather
    on a CPU, where Triton only runs in its (slow) interpreter."""
    if backend != "auto":
        return backend
    return "triton" if is_cuda else "gather"


class MoeRun:
    def __init__(self, options: MoeOptions, core) -> None:
        self.options = options
        self.core = core  # pytest_moeperf.session.MoePerfSession: device, gate, results
        self.ab_reports: list = []  # the A/B ladder reports the suites wrote (their Markdown files)
        self.ab_verdicts: list[str] = []  # each ladder row's verdict against the first, for the terminal

    @property
    def dtype_name(self) -> str:
        # bf16 is what a GPU decodes in; fp32 on CPU, where bf16 matmuls are emulated and slow.
        return "bfloat16" if self.core.device.is_cuda else "float32"

    @property
    def moe_backend(self) -> str:
        return moe_backend_under_test(self.options.backend, self.core.device.is_cuda)

    def backends_under_test(self) -> list[str]:
        """The MoE backends a correctness suite checks: the one under test and, when it was left
        to `auto` on a CPU, `triton` as well (in Triton's interpreter), so that a CPU-only CI
        checks the kernel source the GPU runs."""
        names = [self.moe_backend]
        if self.options.backend == "auto" and "triton" not in names:
            names.append("triton")
        return names

    @cached_property
    def checkpoint_digest(self) -> str | None:
        """impl.digests.folder_digest of the model's folder, when --moe-model names one (a preset or an
        embedded checkpoint is named by the code)."""
        from impl.digests import folder_digest
        path = Path(self.options.model)
        return folder_digest(path) if path.is_absolute() and path.is_dir() else None  # parse_model: folders absolute

    def run_config(self) -> dict:
        """What every gated figure of this run depends on besides the device."""
        config = {"model": self.options.model, "dtype": self.dtype_name, "moe_backend": self.moe_backend}
        if self.checkpoint_digest is not None:  # a checkpoint replaced at the same path is another model
            config["checkpoint"] = self.checkpoint_digest
        if self.options.head != "bf16":  # figures frozen before the option existed stay comparable
            config["head"] = self.options.head
        return config

    def summary_lines(self) -> list[str]:
        lines = [f"A/B ladder report: {md} (every request in the JSON beside it, figures as PNG)"
                 for md in self.ab_reports]
        return lines + self.ab_verdicts


# The keys of run_config that name a configuration (a checkpoint's digest and the head key the
# comparison without deciding which frozen figures a run was expected to measure).
SCOPE_KEYS = ("model", "dtype", "moe_backend")
HARNESS_KEY = pytest.StashKey[MoeRun]()
