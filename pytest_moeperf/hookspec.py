"""Hooks through which a harness (the MoE harness, `moe_harness`, or a user's own) feeds the gate
core: its options and state, what its figures are frozen under, and what the run's header and
summary say of it. The core calls them; it knows nothing of what a harness measures."""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_moeperf_configure(config: pytest.Config, session) -> None:
    """The core's options are parsed and its session (`MoePerfSession`) made, nothing measured
    yet: parse the harness's own options and keep its state. A ValueError is a usage error."""


@pytest.hookspec
def pytest_moeperf_run_config(session) -> dict:
    """What every gated figure of this run depends on besides the device (e.g. the model and the
    backend under test): merged over the plugins into each figure's frozen configuration, so a
    figure is compared only with one frozen under the same values."""


@pytest.hookspec
def pytest_moeperf_scope_keys(session) -> list[str]:
    """The keys of the run configuration that name a configuration (a figure frozen under other
    values of them is another configuration's, not one this run failed to measure); keys left out
    (e.g. a checkpoint's digest) still key the comparison."""


@pytest.hookspec
def pytest_moeperf_header(session) -> dict:
    """Fields for the run's header (terminal and report), e.g. {"model": ...}."""


@pytest.hookspec
def pytest_moeperf_summary_lines(session) -> list[str]:
    """Lines for the end of the run's summary (after the core's), e.g. where a report was written."""
