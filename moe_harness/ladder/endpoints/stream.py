"""One streamed completion from an OpenAI-compatible server, timed as vLLM's and SGLang's serving
benchmarks time it.

The request asks for a stream with `stream_options.include_usage`, so the server's own count of
the tokens it generated arrives in the last chunk (`usage.completion_tokens`). Times are taken on
the host's monotonic clock from just before the request is sent: TTFT when the first chunk
carrying text arrives (a chat stream's first chunk only names the role), latency when the last
chunk carrying text does (the usage chunk after it is not output), and the gap before every later
text chunk (`itl_s`). A speculative server sends every token a verify step accepted in one chunk,
so those gaps are not TPOT (vLLM #27485); TPOT is (latency - TTFT) / (completion tokens - 1).

A stop the server cannot express (the arithmetic workload's END counts only after `#### `:
impl.data.workloads.Request.stop_index) is the client's, as this project's engine stops on the
host: `stop_at(text)` gives where the answer ends once it has; the request ends at the chunk that
completes it (its latency), the text is cut there and the stream is closed, which aborts the
request on the server. The server's usage never comes then; the caller counts the tokens.

Whatever goes wrong is the request's `error`, never an exception: an HTTP status other than 200
(with the start of its body), a stream cut mid-response, a malformed SSE line (with the line), an
error event, a stream without its end (`[DONE]`), a timeout, a refused connection. The caller
decides whether the ladder goes on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

__all__ = ["Streamed", "stream_completion"]


@dataclass
class Streamed:
    """What one streamed request gave: its text, times (seconds from the request's start), the
    server's token counts, the last chunk's extra blocks (vLLM's per-request `metrics`, SGLang's
    `meta_info` / `sglext`), and `error` when it failed."""

    text: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    extras: dict = field(default_factory=dict)
    error: str | None = None
    chunks: int = 0
    stopped_by_client: bool = False  # `stop_at` ended it: no usage from the server
    received: str = ""  # every character received, past the cut too


EXTRA_BLOCKS = ("metrics", "meta_info", "sglext")  # per-request blocks some servers add to a chunk


def _text_of(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def stream_completion(client: httpx.Client, url: str, payload: dict, *, chat: bool = False,
                      headers: dict | None = None, timeout_s: float = 300.0,
                      stop_at: Callable[[str], int | None] | None = None) -> Streamed:
    """POST `payload` (stream settings added) to `url` (a /v1/completions or /v1/chat/completions
    endpoint) and read the stream to its end, or to where `stop_at` says the answer ends."""
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    out = Streamed()
    start = time.perf_counter()
    last_text_at: float | None = None
    done = False
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as response:
            if response.status_code != 200:
                content = response.read().decode("utf-8", "replace")
                out.error = f"HTTP {response.status_code} from {url}: {content[:300]}"
                return out
            for line in response.iter_lines():
                if not line or line.startswith(":"):  # the blank line between events; SSE comments
                    continue
                if not line.startswith("data:"):
                    out.error = f"malformed SSE line (no 'data:') after {out.chunks} chunk(s): {line[:200]!r}"
                    return out
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter() - start
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError as e:
                    out.error = f"malformed SSE line after {out.chunks} chunk(s) ({e}): {line[:200]!r}"
                    return out
                if not isinstance(chunk, dict):
                    out.error = f"malformed SSE event after {out.chunks} chunk(s): {data[:200]!r}"
                    return out
                if "error" in chunk:
                    out.error = f"the server sent an error event after {out.chunks} chunk(s): {chunk['error']}"
                    return out
                out.chunks += 1
                for choice in chunk.get("choices") or ():
                    text = _text_of(choice, chat)
                    if text:
                        if out.ttft_s is None:
                            out.ttft_s = now
                        else:
                            out.itl_s.append(now - last_text_at)
                        last_text_at = now
                        out.text += text
                        end = stop_at(out.text) if stop_at is not None else None
                        if end is not None:
                            out.received = out.text
                            out.text, out.stopped_by_client, out.finish_reason = out.text[:end], True, "stop"
                            out.latency_s = now
                            return out  # leaving the block closes the stream: the server aborts
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    out.completion_tokens = usage.get("completion_tokens")
                    out.prompt_tokens = usage.get("prompt_tokens")
                for key in EXTRA_BLOCKS:
                    if isinstance(chunk.get(key), dict):
                        out.extras[key] = chunk[key]
    except httpx.TimeoutException as e:
        out.error = f"timed out after {time.perf_counter() - start:.1f} s ({type(e).__name__}) at {url}"
        return out
    except httpx.ConnectError as e:
        out.error = f"cannot connect to {url}: {e}"
        return out
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.StreamError) as e:
        out.error = f"the stream was cut after {out.chunks} chunk(s): {type(e).__name__}: {e}"
        return out
    if not done:
        out.error = f"the stream ended after {out.chunks} chunk(s) without its end ([DONE])"
        return out
    out.latency_s, out.received = last_text_at, out.text
    if out.completion_tokens is None:
        out.error = "the server reported no usage (stream_options.include_usage): no token count for TPOT"
    return out
