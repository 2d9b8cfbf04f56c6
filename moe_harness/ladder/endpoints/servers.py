"""Server rows' definitions: a TOML file (`--moe-servers FILE`), one `[[server]]` table a row.

    [vars]                      # optional: your own {names} for the commands below
    vllm = "{rootdir}/.venv-vllm/bin/python"

    [[server]]                  # a server the plugin starts, waits for and stops
    name = "vllm-mtp"
    command = ["{vllm}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
               "--port", "{port}", "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']
    env = { VLLM_CPU_KVCACHE_SPACE = "1" }
    speculative = 3             # declared: it drafts 3 tokens a step; acceptance must show it
    startup_timeout_s = 300
    nice = 10                   # a lower priority than the timing client's (0-19; a host the servers fill)

    [[server]]                  # a server you started
    name = "mine"
    url = "http://127.0.0.1:8000"
    api_key_env = "MY_KEY"      # the key is read from this variable, sent as a bearer token, never written
    chat = true                 # /v1/chat/completions (default /v1/completions)

    [ladder]                    # optional
    rows = "vllm-plain;vllm-mtp"  # the ladder without --moe-ladder (default: every server, in order);
                                # as --moe-ladder takes it, so this engine's rows may be named too
    block = 10                  # requests a row serves in turn, A B then B A (default: request by request)
    one_at_a_time = true        # servers that cannot be up together (one GPU's memory): each managed
                                # server started before its block, stopped after

Placeholders in a command and its environment: {port} (a free port on 127.0.0.1, chosen at
start), {host}, {model} (--moe-model: a checkpoint folder's absolute path, or an embedded
checkpoint's folder), {python} (this interpreter), {rootdir}, {here} (the file's folder), and the
[vars] table's names (which may use the built-in ones). Every key is checked: an unknown one, a
wrong type, a row with both or neither of `url` and `command`, a repeated name, an unknown
placeholder: a usage error naming the file and the row.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["ServerDef", "ServerFile", "ServerFileError", "ladder_rows", "load_servers", "parse_url_row"]

ENGINES = ("auto", "vllm", "sglang", "moeperf", "openai")
KEYS = {"name": str, "url": str, "command": list, "env": dict, "engine": str, "speculative": int, "chat": bool,
        "api_key_env": str, "model": str, "startup_timeout_s": (int, float), "timeout_s": (int, float), "nice": int}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class ServerFileError(ValueError):
    """A server definitions file that cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class ServerDef:
    """One server row: `url` (started by you) or `command` + `env` (started by the plugin, with the
    placeholders left for `resolve`). `speculative`: the drafts a step it declares (0: none)."""

    name: str
    url: str | None = None
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    engine: str = "auto"
    speculative: int = 0
    chat: bool = False
    api_key_env: str | None = None
    model: str | None = None  # the served model id to request; default the first of /v1/models
    startup_timeout_s: float = 300.0
    timeout_s: float = 300.0  # one request's limit
    # Added to a managed server's niceness: on a host whose cores the servers fill, the timing
    # client must get a core the moment a chunk arrives, or it reads a burst late.
    nice: int = 0
    source: str = ""  # "FILE [[server]] #i" or "--moe-ladder": where it was defined, for messages
    vars: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def managed(self) -> bool:
        return bool(self.command)

    def definition(self) -> dict:
        """What the row is, as frozen figures are keyed and the report shows it: never a key's value."""
        return {k: v for k, v in (("url", self.url), ("command", list(self.command)), ("env", dict(self.env)),
                                  ("engine", self.engine), ("speculative", self.speculative), ("chat", self.chat),
                                  ("model", self.model)) if v not in (None, (), [], {})}

    def resolve(self, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command and environment with every placeholder filled from `values` and [vars]."""
        table = dict(values)
        for key, value in self.vars:  # [vars] may use the built-ins
            table[key] = _fill(value, table, f"{self.source}: [vars] {key}")
        return ([_fill(part, table, f"{self.source}: command") for part in self.command],
                {k: _fill(v, table, f"{self.source}: env {k}") for k, v in self.env})


def _fill(text: str, values: dict[str, str], where: str) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ServerFileError(f"{where}: unknown placeholder {{{m.group(1)}}}; known: "
                                  f"{', '.join(sorted(values))}")
        return str(values[m.group(1)])
    # A JSON argument such as '{"method":"mtp"}' has braces around quotes, not a bare word: left alone.
    return _PLACEHOLDER.sub(one, text)


def builtin_values(port: int, model: str, rootdir: Path, here: Path) -> dict[str, str]:
    return {"port": str(port), "host": "127.0.0.1", "model": model, "python": sys.executable,
            "rootdir": str(rootdir), "here": str(here)}


def _row(raw, where: str, vars_: tuple) -> ServerDef:
    if not isinstance(raw, dict):
        raise ServerFileError(f"{where}: a [[server]] table is expected")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ServerFileError(f"{where}: unknown key(s) {unknown}; known: {', '.join(KEYS)}")
    for key, value in raw.items():
        kind = KEYS[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ServerFileError(f"{where}: {key} = {value!r} is not a {getattr(kind, '__name__', 'number')}")
    if not raw.get("name") or not re.fullmatch(r"[\w.+-]+", raw["name"]):
        raise ServerFileError(f"{where}: needs a name of letters, digits, '.', '+', '-' or '_', got "
                              f"{raw.get('name')!r}")
    where = f"{where} ({raw['name']!r})"
    if bool(raw.get("url")) == bool(raw.get("command")):
        raise ServerFileError(f"{where}: give either url (a server you started) or command (one the plugin starts)")
    if "command" in raw and not all(isinstance(p, str) and p for p in raw["command"]):
        raise ServerFileError(f"{where}: command must be a list of non-empty strings")
    if "env" in raw and not all(isinstance(v, str) for v in raw["env"].values()):
        raise ServerFileError(f"{where}: env values must be strings")
    if raw.get("engine", "auto") not in ENGINES:
        raise ServerFileError(f"{where}: engine {raw['engine']!r} is not one of {', '.join(ENGINES)}")
    if raw.get("speculative", 0) < 0:
        raise ServerFileError(f"{where}: speculative is the drafts a step (0 for none), got {raw['speculative']}")
    for key in ("startup_timeout_s", "timeout_s"):
        if key in raw and raw[key] <= 0:
            raise ServerFileError(f"{where}: {key} must be positive, got {raw[key]}")
    if not 0 <= raw.get("nice", 0) <= 19:
        raise ServerFileError(f"{where}: nice must be 0 to 19 (a lower priority than the client's), got {raw['nice']}")
    if raw.get("url"):
        parse_url(raw["url"], where)
    return ServerDef(raw["name"], raw.get("url", "").rstrip("/") or None, tuple(raw.get("command", ())),
                     tuple(sorted(raw.get("env", {}).items())), raw.get("engine", "auto"), raw.get("speculative", 0),
                     raw.get("chat", False), raw.get("api_key_env"), raw.get("model"),
                     float(raw.get("startup_timeout_s", 300.0)), float(raw.get("timeout_s", 300.0)),
                     raw.get("nice", 0), where, vars_)


def parse_url(url: str, where: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url):
        raise ServerFileError(f"{where}: {url!r} is not an http(s)://HOST:PORT address")
    return url.rstrip("/")


@dataclass(frozen=True)
class ServerFile:
    """A definitions file's rows (iterated as the rows), its default ladder and its [ladder] schedule."""

    rows: tuple[ServerDef, ...]
    block: int | None = None
    one_at_a_time: bool = False
    ladder: str | None = None  # [ladder] rows: the ladder text when --moe-ladder gives none

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def _schedule(raw, path: Path) -> tuple[int | None, bool, str | None]:
    if not isinstance(raw, dict) or set(raw) - {"rows", "block", "one_at_a_time"}:
        raise ServerFileError(f"{path}: [ladder] takes rows (the default ladder), block (requests a row serves in "
                              f"turn) and one_at_a_time, got {raw!r}")
    block, alone, rows = raw.get("block"), raw.get("one_at_a_time", False), raw.get("rows")
    if rows is not None and (not isinstance(rows, str) or not rows.strip()):
        raise ServerFileError(f"{path}: [ladder] rows must be a ladder as --moe-ladder takes it "
                              f"(e.g. \"vllm-plain;vllm-mtp\"), got {rows!r}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ServerFileError(f"{path}: [ladder] block must be a number of requests >= 1, got {block!r}")
    if not isinstance(alone, bool):
        raise ServerFileError(f"{path}: [ladder] one_at_a_time must be true or false, got {alone!r}")
    if alone and block is None:
        raise ServerFileError(f"{path}: [ladder] one_at_a_time needs a block: request by request, every server "
                              "would restart for every request")
    return block, alone, rows


def load_servers(path: Path) -> ServerFile:
    """The rows of a server definitions file, in its order, and its schedule (module docstring)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ServerFileError(f"{path}: cannot be read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ServerFileError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(raw) - {"server", "vars", "ladder"})
    if unknown:
        raise ServerFileError(f"{path}: unknown table(s) {unknown}; expected [[server]], [vars] and [ladder]")
    block, alone, ladder = _schedule(raw.get("ladder", {}), path)
    vars_ = raw.get("vars", {})
    if not isinstance(vars_, dict) or not all(isinstance(v, str) for v in vars_.values()):
        raise ServerFileError(f"{path}: [vars] must map names to strings")
    servers = raw.get("server")
    if not isinstance(servers, list) or not servers:
        raise ServerFileError(f"{path}: no [[server]] table")
    rows = [_row(r, f"{path} [[server]] #{i + 1}", tuple(vars_.items())) for i, r in enumerate(servers)]
    names = [r.name for r in rows]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ServerFileError(f"{path}: server name(s) {repeated} appear more than once")
    return ServerFile(tuple(rows), block, alone, ladder)


def parse_url_row(name: str, url: str) -> ServerDef:
    """A `NAME=http://HOST:PORT` ladder row: a server the user started."""
    return ServerDef(name, parse_url(url, f"--moe-ladder row {name!r}"), source=f"--moe-ladder row {name!r}")


def ladder_rows(text: str | None, servers, device, k: int | None = None) -> list:
    """The ladder's rows in order: impl.serve.rows.Row for this engine's rows, ServerDef for
    servers. `text` as --moe-ladder takes it (rows separated by ";"): a row `NAME=http://HOST:PORT`
    is a server you started, a bare name of `servers` that server, anything else this engine's
    row (impl.serve.rows.parse_row). Without `text`, the file's [ladder] rows, else its servers
    in order. Names must differ."""
    from impl.serve.rows import DEFAULT_K, parse_ladder, parse_row
    if (text is None or not text.strip()) and isinstance(servers, ServerFile):
        text = servers.ladder
    servers = list(servers)
    if text is None or not text.strip():
        if not servers:
            raise ValueError("empty ladder: give --moe-ladder rows or a --moe-servers file")
        return list(servers)
    by_name = {s.name: s for s in servers}
    if not any(p.strip() in by_name or "://" in p for p in text.split(";")):
        return parse_ladder(text, device, k or DEFAULT_K)  # this engine's rows only: its own syntax
    rows = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            raise ValueError(f"ladder {text!r}: an empty row (rows are separated by ';')")
        name, _, rest = part.partition("=")
        if rest.startswith(("http://", "https://")):
            rows.append(parse_url_row(name.strip(), rest.strip()))
        elif part in by_name:
            rows.append(by_name[part])
        else:
            try:
                rows.append(parse_row(part, device, k or DEFAULT_K))
            except ValueError as e:
                raise ValueError(f"ladder row {part!r}: {e} (nor is it a server of --moe-servers: "
                                 f"{', '.join(by_name) or 'none given'})") from None
    names = [r.name for r in rows]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"ladder {text!r}: row names {repeated} appear more than once")
    return rows
