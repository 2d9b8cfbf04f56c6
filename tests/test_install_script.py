"""scripts/install.sh hands uv what pip is configured with (uv reads none of pip's files): every
configured index, find-links folder and constraints file, once each, in pip's order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sources(config: Path) -> list[str]:
    venv = Path(sys.executable).parent.parent  # the venv running the tests: it has pip
    out = subprocess.run(["bash", "-c", f'. scripts/install.sh && _pip_sources_for_uv "{venv}"'], cwd=ROOT,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PIP_CONFIG_FILE": str(config)}).stdout
    return out.splitlines()


def test_pips_indexes_find_links_and_constraints_become_uv_arguments(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url = file:///srv/a/simple file:///srv/b/simple\n"
                      "find-links = /srv/wheels\nconstraint = /srv/caps.txt\ntimeout = 60\n")
    args = _sources(config)
    pairs = list(zip(args[::2], args[1::2]))
    for pair in [("--extra-index-url", "file:///srv/a/simple"), ("--extra-index-url", "file:///srv/b/simple"),
                 ("--find-links", "/srv/wheels"), ("--constraint", "/srv/caps.txt")]:
        assert pairs.count(pair) == 1, pairs
    assert all(flag.startswith("--") for flag, _ in pairs) and "60" not in args, pairs  # other keys are not sources
