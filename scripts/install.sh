# Sourced by scripts/setup-env and scripts/setup-vllm: `install VENV ARGS...` installs pip-style
# ARGS (requirements, -c, -e, --extra-index-url) into the venv at VENV.
#
# Through uv where it can be had (installed into VENV with pip): on the 2-core CI machine uv made
# .venv in 57 s and .venv-vllm in 54 s, where pip took 97-142 s and 134 s (it unpacks and
# byte-compiles on one core). uv reads none of pip's configuration, so it is given pip's
# configured indexes, find-links and constraints, and pip's rule of taking the best version
# across all indexes. Byte-compiled at install as pip does: where PYTHONDONTWRITEBYTECODE is set
# nothing would ever write the .pyc files, and every process would compile what it imports
# (importing torch, transformers and scipy took 11.3 s instead of 6.3 s). Where uv cannot be
# installed or fails, pip does the same install.

_pip_sources_for_uv() {  # pip's configured sources and constraints as uv arguments, one a line
  "$1/bin/python" - <<'PY'
import shlex, subprocess, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = []
for line in listed.splitlines():
    scoped, _, value = line.partition("=")
    key = scoped.rsplit(".", 1)[-1]
    if key in flags:
        for item in shlex.split(value.strip().strip("'\"")):
            if (flags[key], item) not in seen:
                seen.append((flags[key], item))
for flag, item in seen:
    print(flag)
    print(item)
PY
}

install() {
  local venv=$1
  shift
  if "$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1; then
    local sources=()
    mapfile -t sources < <(_pip_sources_for_uv "$venv")
    if "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --index-strategy unsafe-best-match \
        --compile-bytecode "${sources[@]}" "$@"; then
      return 0
    fi
    echo "install: uv failed; installing with pip instead" >&2
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
