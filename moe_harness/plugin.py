"""pytest wiring of the MoE harness: its options, its state, the hooks through which it feeds the
gate core (pytest_moeperf.hookspec), the per-backend parametrization and planted slowdowns."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from moe_harness import options as harness_options
from moe_harness.fixtures import moe_backend, moe_checked_backend, moe_model, moe_run  # noqa: F401  (registered by import)
from moe_harness.state import HARNESS_KEY, SCOPE_KEYS, MoeRun, moe_backend_under_test
from pytest_moeperf.options import from_ini, option


def pytest_addoption(parser: pytest.Parser) -> None:
    harness_options.add_options(parser)


def pytest_moeperf_configure(config: pytest.Config, session) -> None:
    """Parse the harness's options and check, before anything is measured, what every test would
    otherwise fail on: the checkpoint (under --moe-bench) and the ladder's rows."""
    options = harness_options.parse_options(config, session.options)
    plants = _parse_plants(config, options.backend, session)
    run = MoeRun(dataclasses.replace(options, plants=plants), session)
    config.stash[HARNESS_KEY] = run
    if plants:
        _plant_module().activate(plants, session.device.torch_device)
    if session.options.bench:
        try:  # read once here: an unreadable file is a usage error, not an error in every gated test
            run.checkpoint_digest
        except OSError as e:
            raise ValueError(f"--moe-model {run.options.model}: cannot read the checkpoint to name what its "
                             f"figures are frozen under: {e}") from None
    opts = run.options
    if opts.ladder is not None or opts.servers:  # checked with or without --moe-bench: a typo waits for no run
        try:
            harness_options.parse_ladder_option(opts.ladder, session.device.torch_device.type, opts.servers)
        except ValueError as e:
            raise ValueError(from_ini(config, "moe_ladder", str(e))) from None


def _parse_plants(config: pytest.Config, backend: str, session) -> tuple:
    """--moe-plant's planted slowdowns (impl.plant.Plant), `moe` naming the backend under test
    (--moe-backend `backend` on the session's device, resolved only here: a run without plants
    never needs the device)."""
    spec = option(config, "moe_plant")
    if not spec:
        return ()
    moe_backend = moe_backend_under_test(backend, session.device.is_cuda)
    try:
        return _plant_module().parse_plants(spec, {"moe": moe_backend})
    except ValueError as e:
        raise ValueError(from_ini(config, "moe_plant", f"--moe-plant: {e}")) from None


def _run(session) -> MoeRun | None:
    return session.config.stash.get(HARNESS_KEY, None) if session.config is not None else None


def pytest_moeperf_run_config(session) -> dict:
    run = _run(session)
    return run.run_config() if run else {}


def pytest_moeperf_scope_keys(session) -> list[str]:
    return list(SCOPE_KEYS)


def pytest_moeperf_header(session) -> dict:
    run = _run(session)
    if run is None:
        return {}
    header = {"model": run.options.model, "moe_backend": run.moe_backend}
    if run.options.plants:
        header["planted"] = ", ".join(map(str, run.options.plants))
    return header


def pytest_moeperf_summary_lines(session) -> list[str]:
    run = _run(session)
    return run.summary_lines() if run else []


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A test asking for `moe_backend_name` runs once per backend under test.
    if "moe_backend_name" in metafunc.fixturenames:
        run = metafunc.config.stash[HARNESS_KEY]
        metafunc.parametrize("moe_backend_name", run.backends_under_test(), scope="session")


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(HARNESS_KEY, None)
    if run is not None and run.options.plants:
        _plant_module().deactivate()


def _plant_module():
    """impl.plant as sys.modules has it: the module `impl.backends.get` consults (an attribute of
    the impl package can outlive its sys.modules entry, as pytester's in-process runs show)."""
    return importlib.import_module("impl.plant")
