"""The gate's report file (pytest_moeperf/report.py): which code its figures came from."""

from __future__ import annotations

import subprocess

from pytest_moeperf.report import checkout_commit


def test_the_commit_is_named_and_uncommitted_changes_are_flagged(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    git("add", "kernel.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=12", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert checkout_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert checkout_commit(tmp_path) == head + "+changes"
    assert checkout_commit(tmp_path / "kernel.py") is None  # not a folder of a checkout
