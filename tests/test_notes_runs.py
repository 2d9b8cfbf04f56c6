"""Every log in notes/runs/ is named by a note (or a doc, a baseline, the code), and every
notes/runs/ path named exists: scripts/check_notes_runs.py, whose exit status says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_log_in_notes_runs_is_cited_and_every_cited_log_exists():
    done = subprocess.run([sys.executable, "scripts/check_notes_runs.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_fails_on_a_log_no_note_names(tmp_path):
    """Negative control: a copy of the notes with one log nobody names fails the check."""
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(tmp_path / "r")], check=True,
                   capture_output=True, timeout=120)
    planted = "2099-01-01-" + "nobody-names-this.log"  # split: this file must not name it itself
    (tmp_path / "r" / "notes" / "runs" / planted).write_text("x\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_notes_runs.py")], cwd=tmp_path / "r",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"uncited: notes/runs/{planted}" in done.stdout, done.stdout
