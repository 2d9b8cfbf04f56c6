#!/usr/bin/env python3
"""List files in notes/runs/ that nothing names by exact file name, and notes/runs/ paths named
but missing. Searched: README.md, docs/, notes/*.md, baselines/ and every tracked .py file.
Exit status 1 when either list is non-empty. Run from the repository root."""
import pathlib, re, subprocess, sys

root = pathlib.Path(".")
tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
sources = ["README.md", *(f for f in tracked if f.startswith(("docs/", "baselines/"))
                          or re.fullmatch(r"notes/[^/]+\.md", f) or f.endswith(".py"))]
text = "\n".join((root / f).read_text(errors="replace") for f in sources if (root / f).is_file())
runs = sorted(p.name for p in (root / "notes" / "runs").iterdir() if p.is_file())
uncited = [name for name in runs if name not in text]
missing = sorted(set(re.findall(r"notes/runs/([\w.-]*\w)", text)) - set(runs))
for name in uncited:
    print("uncited: notes/runs/" + name)
for name in missing:
    print("named but missing: notes/runs/" + name)
sys.exit(1 if uncited or missing else 0)
