"""A ladder row served over HTTP by an OpenAI-compatible server, as the runner interleaves rows
(impl.serve.ladder): `prepare` (start a managed server, wait for it, ask what it is), `serve`
(one streamed request, timed, with the acceptance the server reports), `check`, `release`,
`entry` (what the report shows), `stop`.

Provenance of a server row is what the server says of itself (engine, version, served model,
its arguments where it tells them) and what it did: a row declared speculative (`speculative =
k`) must show verify steps with drafts, and a mean accept length above the floor
(moe_harness.ladder.summary.ACCEPT_LENGTH_FLOOR); one whose counters never moved, or whose server says it does
not speculate, contradicts its definition (the reference result's trap: every flag says MTP is
on while nothing is accepted). A row not declared speculative whose server drafts is one too.

Secrets: an API key is read from the environment variable the row names and sent as a bearer
header; it is never part of the row's definition, its entry, the report or a frozen key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from impl.serve.result import Acceptance, RowEntry, ServedRequest
from moe_harness.ladder.endpoints import engines
from moe_harness.ladder.endpoints.managed import ManagedServer, free_port
from moe_harness.ladder.endpoints.metrics import SpecCounters, requests_running, vllm_spec_counters
from moe_harness.ladder.endpoints.servers import ServerDef, builtin_values
from moe_harness.ladder.endpoints.stream import stream_completion

__all__ = ["ServerRow", "ServerRowError"]

# A declared-speculative row whose mean accept length is below this accepts almost nothing (the
# same floor the summary flags at: half a draft a step).
ACCEPT_FLOOR = 1.5
# After a failed request, how long to wait for a managed server's exit to be reaped before saying it
# is still running: a failure is terminal for the ladder, so the wait costs nothing measured.
SERVER_EXIT_WAIT_S = 2.0


class ServerRowError(RuntimeError):
    """A server row that cannot serve: its key's variable unset, the server unreachable or unhealthy."""


# A server that has just started on a loaded 2-core machine took over 10 s to answer /server_info
# (a vLLM CPU build beside three others): its description is read once a row, so it may wait.
DESCRIBE_TIMEOUT_S = 60.0


def _get_json(client: httpx.Client, url: str, headers: dict) -> dict | None:
    """The JSON a GET returns, None for a missing endpoint (404/405) or a body that is not JSON."""
    try:
        response = client.get(url, headers=headers, timeout=DESCRIBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


class ServerRow:
    def __init__(self, spec: ServerDef, *, tokenizer, log_dir: Path, model: str, rootdir: Path,
                 here: Path | None = None) -> None:
        self.spec, self.name, self.tokenizer = spec, spec.name, tokenizer
        self.log_dir, self.model_path, self.rootdir, self.here = Path(log_dir), model, Path(rootdir), here or rootdir
        self.client = httpx.Client()
        self.server: ManagedServer | None = None
        self.base_url = spec.url
        self.info: engines.ServerInfo | None = None
        self.metrics_available = False
        self.requests = 0
        self.drafted_steps = 0
        self.accepted = 0
        self.acceptance_sources: set[str] = set()

    # -- the key, never written anywhere -------------------------------------------------------
    def _headers(self) -> dict:
        if not self.spec.api_key_env:
            return {}
        key = os.environ.get(self.spec.api_key_env)
        if not key:
            raise ServerRowError(f"row {self.name!r}: api_key_env names {self.spec.api_key_env!r}, which is not set")
        return {"Authorization": f"Bearer {key}"}

    # -- the row protocol ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the server of a managed row (not waiting for it: several start side by side)."""
        if self.spec.managed and (self.server is None or not self.server.alive()):
            port = free_port()
            self.base_url = f"http://127.0.0.1:{port}"
            command, env = self.spec.resolve(builtin_values(port, self.model_path, self.rootdir, self.here))
            self.server = ManagedServer(self.name, command, env, self.base_url, self.log_dir / f"server-{self.name}.log",
                                        startup_timeout_s=self.spec.startup_timeout_s, nice=self.spec.nice)
            self.server.start()

    def prepare(self) -> None:
        """Start the server (a managed row), wait until it is healthy and learn what it is."""
        headers = self._headers()
        self.start()
        if self.server is not None:
            self.server.wait_healthy(self.client)
        if self.info is None:
            self.info = self._describe(headers)

    def _describe(self, headers: dict) -> engines.ServerInfo:
        base = self.base_url
        models = _get_json(self.client, base + "/v1/models", headers)
        if models is None:
            raise ServerRowError(f"row {self.name!r}: {base}/v1/models did not answer with JSON: is this an "
                                 "OpenAI-compatible server, and is its key right?")
        version = _get_json(self.client, base + "/version", headers)
        info = (_get_json(self.client, base + "/server_info?config_format=json", headers)
                or _get_json(self.client, base + "/get_server_info", headers))
        engine = self.spec.engine if self.spec.engine != "auto" else engines.detect_engine(models, version, info)
        described = engines.server_info(engine, models, version, info)
        self.metrics_available = self._counters(headers) is not None
        if self.spec.model:
            ids = [m.get("id") for m in models.get("data", [])]
            if self.spec.model not in ids:
                raise ServerRowError(f"row {self.name!r}: model {self.spec.model!r} is not served at {base} ({ids})")
            described = engines.ServerInfo(described.engine, described.version, self.spec.model, described.root,
                                           described.args, described.speculative)
        return described

    def _counters(self, headers: dict) -> SpecCounters | None:
        """The server's speculative-decoding counters now (all 0 before its first draft: a counter
        with labels has no sample until then); None where it has no readable /metrics."""
        try:
            response = self.client.get(self.base_url + "/metrics", headers=headers, timeout=10.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return vllm_spec_counters(response.text) or SpecCounters(0.0, 0.0, 0.0, ())
        except ValueError:
            return None

    def _payload(self, request) -> dict:
        payload = {"model": self.info.model, "max_tokens": request.max_tokens, "temperature": 0.0}
        if self.spec.chat:
            payload["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            payload["prompt"] = request.prompt
        if request.stop and not getattr(request, "stop_from", None):
            payload["stop"] = list(request.stop)  # stops the server can keep itself
        if getattr(request, "ignore_eos", False):
            payload["ignore_eos"] = True  # vLLM's and SGLang's extension
        if self.info.engine == "sglang":
            payload["return_spec_tokens_details"] = True
        return payload

    def serve(self, request) -> ServedRequest:
        if not request.prompt:
            raise ServerRowError(f"row {self.name!r}: request {request.request_id!r} has no prompt text (synthetic ids "
                                 "cannot be sent to a server)")
        headers = self._headers()
        before = self._counters(headers) if self.metrics_available else None
        stop_at = request.stop_index if getattr(request, "stop_from", None) else None
        path = "/v1/chat/completions" if self.spec.chat else "/v1/completions"
        got = stream_completion(self.client, self.base_url + path, self._payload(request), chat=self.spec.chat,
                                headers=headers, timeout_s=self.spec.timeout_s, stop_at=stop_at)
        self.requests += 1
        if got.error is not None and self.server is not None and self.server.exited_within(SERVER_EXIT_WAIT_S):
            got.error += (f"; the managed server {self.name!r} is no longer running (exit status "
                          f"{self.server.returncode()}), the last lines of {self.server.log_path}:\n"
                          f"{self.server.log_tail(8)}")
        if got.error is None and got.stopped_by_client:
            self._settle(headers)
        acceptance = None
        if got.error is None:
            acceptance = engines.acceptance_from_block(got.extras, got.completion_tokens)
            if acceptance is None and before is not None:
                after = self._counters(headers)
                if after is not None:
                    acceptance = engines.acceptance_from_counters(after - before, f"{self.info.engine} /metrics")
            if acceptance is not None:
                self.drafted_steps += acceptance.verify_steps
                self.accepted += acceptance.accepted
                self.acceptance_sources.add(acceptance.source)
        return ServedRequest(self.name, request.request_id, got.prompt_tokens or len(request.prompt_ids),
                             self._tokens(got, request), got.ttft_s if got.error is None else None,
                             got.latency_s if got.error is None else None, got.text, None, got.finish_reason,
                             acceptance, tuple(got.itl_s), got.error)

    def _tokens(self, got, request) -> int:
        """The request's output tokens: the server's count, or where the client stopped it, the
        tokens of the text through the stop string (the token that ends a request counts, as
        this project's engine and vLLM count it)."""
        if got.error is not None:
            return 0
        if not got.stopped_by_client:
            return got.completion_tokens
        end = len(got.text)
        stop = next((s for s in request.stop if got.received.startswith(s, end)), "")
        return len(self.tokenizer.encode(got.text + stop))

    def _settle(self, headers: dict, limit_s: float = 5.0) -> None:
        """After a request the client cut, wait until the server has let it go (its running count
        0), so that its last steps are counted with it and not with the next request."""
        import time
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            try:
                running = requests_running(self.client.get(self.base_url + "/metrics", headers=headers,
                                                           timeout=5.0).text)
            except (httpx.HTTPError, ValueError):
                return
            if not running:
                return
            time.sleep(0.01)

    def problems(self) -> list[str]:
        """What of the row contradicts its definition (see the module docstring)."""
        out = []
        k, said = self.spec.speculative, (self.info.speculative if self.info else None)
        if k:
            if said is not None and said.get("k") not in (None, k):
                out.append(f"declared speculative with k={k}, the server drafts k={said.get('k')} ({said})")
            if said is None and self.info is not None and self.info.args:
                out.append(f"declared speculative (k={k}) but the server's configuration has no speculative "
                           f"decoding ({self.info.engine} {self.info.version})")
            if self.requests and not self.acceptance_sources:
                out.append(f"declared speculative (k={k}) but no acceptance was reported: the server's draft "
                           f"counters never moved ({'no' if not self.metrics_available else 'a'} /metrics "
                           "endpoint): it is not speculating, whatever its flags say")
            elif self.drafted_steps and (self.accepted + self.drafted_steps) / self.drafted_steps < ACCEPT_FLOOR:
                out.append(f"declared speculative (k={k}) but its drafts are almost never accepted: mean accept "
                           f"length {(self.accepted + self.drafted_steps) / self.drafted_steps:.2f} < {ACCEPT_FLOOR}")
        elif self.drafted_steps:
            out.append(f"not declared speculative, but the server drafted in {self.drafted_steps} verify steps")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ServerRowError(f"row {self.name!r} is not what it says: " + "; ".join(problems))

    def release(self) -> None:
        self.stop()

    def suspend(self) -> None:
        """Stop a managed server between its blocks (one server up at a time); a URL row stays up."""
        self.stop()

    def resume(self) -> None:
        """Start a managed server again and wait until it is healthy."""
        self.prepare()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def key(self) -> str:
        """What the row served, as its frozen figures are keyed: engine, version and model as the
        server says, the row's definition (its command and environment with their placeholders,
        not the port it got; never a key) and, for a server you started, the arguments it
        reports. A changed flag or an upgrade is another configuration, never a regression."""
        info = self.info
        key = {"server": {k: v for k, v in self.spec.definition().items() if k != "url"},
               **({} if info is None else info.key())}
        if info is not None and not self.spec.managed:
            key["args"] = info.args
        return "server:" + json.dumps(key, sort_keys=True, separators=(",", ":"))

    def entry(self) -> RowEntry:
        info = self.info
        server = {"definition": self.spec.definition(), "base_url": self.base_url,
                  **({} if info is None else {"engine": info.engine, "version": info.version, "model": info.model,
                                              "root": info.root, "args": info.args, "speculative": info.speculative}),
                  "metrics_endpoint": self.metrics_available,
                  "acceptance_sources": sorted(self.acceptance_sources),
                  "log": None if self.server is None else str(self.server.log_path)}
        provenance = {"requests": self.requests, "speculative": bool(self.spec.speculative),
                      "drafts_per_step": self.spec.speculative, "verify_steps": self.drafted_steps,
                      "engine": None if info is None else info.engine,
                      "version": None if info is None else info.version}
        return RowEntry(self.name, self.key(), speculative=bool(self.spec.speculative), greedy=True, head=None, assumed=False,
                        runs_as=None, provenance=provenance,
                        provenance_error="; ".join(self.problems()) or None, server=server)
