"""This project's engine as an OpenAI-compatible server: one ladder row (a ServeConfig) of one
model, served over HTTP (FastAPI + uvicorn), so that one configuration can be compared in
process, over HTTP and against other engines on the same checkpoint.

    python -m impl.serve --http 8000 --model checkpoints/tiny-gsm --row +mtp

Endpoints: `POST /v1/completions` (streamed as server-sent events with `stream`, the last chunk
carrying `usage` with `stream_options.include_usage`, then `data: [DONE]`; or one JSON answer),
`GET /health`, `/v1/models` (owned by "pytest-moeperf"), `/version`, `/server_info` (the row and
its speculation, as vLLM's `speculative_config` names it), `/metrics` (Prometheus: vLLM's
speculative-decoding counters and running-requests gauge under `moeperf:`, so a client that cuts
a stream at its own stop still reads the request's acceptance).

A speculative row puts its acceptance in the last chunk, in vLLM's per-request form
(`metrics.speculative_decoding`: `num_spec_steps`, `num_accepted_draft_tokens`,
`num_draft_tokens`, `num_spec_tokens`, `mean_acceptance_length`) plus what vLLM's does not
carry: per-position counts and each step's accept length. Requests are served one at a time
(batch 1, as the row runs in process); a client that goes away ends its request at the next step,
which its acceptance does not count (the client never saw its tokens), so a client that cuts the
stream at its own stop reads the acceptance the same request has in process.
Greedy only: the row's own sampling settings apply, a request's temperature must be 0 or absent.
"""


import asyncio
import json
import queue
import threading
import time
import uuid

__all__ = ["make_app", "serve_http"]


def _spec_block(served) -> dict | None:
    a = served.acceptance
    if a is None:
        return None
    k = len(a.per_position or ())
    return {"num_spec_steps": a.verify_steps, "num_accepted_draft_tokens": a.accepted,
            "num_draft_tokens": a.verify_steps * k, "num_spec_tokens": k,
            "mean_acceptance_length": a.accept_length, "accepted_per_position": list(a.per_position or ()),
            "accept_lengths": None if a.lengths is None else list(a.lengths), "source": "moeperf per-request"}


def make_app(row, model_id: str, root: str, version: str):
    """The FastAPI app serving `row` (an impl.serve.engine.EngineRow) as model `model_id`."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from impl.data.workloads import Request as WorkloadRequest

    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    app = FastAPI(title="pytest-moeperf engine")
    lock = threading.Lock()  # batch 1: one request at a time
    registry = CollectorRegistry()
    labels = {"model_name": model_id, "engine": "0"}
    counters = {name: Counter(f"moeperf:spec_decode_{name}", doc, list(labels), registry=registry)
                for name, doc in (("num_drafts", "Verify steps that drafted."), ("num_draft_tokens", "Draft tokens."),
                                  ("num_accepted_tokens", "Accepted draft tokens."))}
    per_pos = Counter("moeperf:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per position.",
                      [*labels, "position"], registry=registry)
    running = Gauge("moeperf:num_requests_running", "Requests being served.", list(labels), registry=registry)
    for counter in counters.values():  # a sample at 0 from the start, as vLLM's
        counter.labels(**labels)
    running.labels(**labels)

    def served_one(request):
        """Serve under the lock, counting what the request's speculation did."""
        def count(served):
            a = served.acceptance
            if a is not None:
                k = len(a.per_position or ())
                counters["num_drafts"].labels(**labels).inc(a.verify_steps)
                counters["num_draft_tokens"].labels(**labels).inc(a.verify_steps * k)
                counters["num_accepted_tokens"].labels(**labels).inc(a.accepted)
                for j, n in enumerate(a.per_position or ()):
                    per_pos.labels(**labels, position=str(j)).inc(n)
            return served
        return count

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")
    config = row.built.config
    speculative = {"method": "mtp", "num_speculative_tokens": config.k} if config.speculative else None

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.get("/version")
    def version_():
        return {"version": version, "engine": "pytest-moeperf"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "pytest-moeperf",
                                            "root": root, "max_model_len": row.built.model.config.max_seq_len}]}

    @app.get("/server_info")
    def server_info():
        return {"version": version, "rows": config.spec_text(), "speculative_config": speculative,
                "model_config": {"model": root, "dtype": str(row.built.model.embed_tokens.weight.dtype)}}

    def _request(body: dict) -> WorkloadRequest:
        if body.get("model", model_id) != model_id:
            raise HTTPException(404, f"model {body.get('model')!r} is not served here; {model_id!r} is")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HTTPException(400, "prompt must be a non-empty string (one prompt a request)")
        if body.get("temperature") not in (None, 0, 0.0):
            raise HTTPException(400, "this server decodes greedily (the row's own sampling): temperature must be 0")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HTTPException(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        try:
            ids = row.built.tokenizer.encode(prompt)
        except ValueError as e:
            raise HTTPException(400, f"prompt: {e}") from None
        return WorkloadRequest(f"cmpl-{uuid.uuid4().hex[:12]}", prompt, ids, None, max_tokens, stop,
                               bool(body.get("ignore_eos", False)))

    def _chunk(rid: str, created: int, **fields) -> str:
        return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model_id,
                                      **fields}) + "\n\n"

    @app.post("/v1/completions")
    async def completions(http: Request):
        try:
            body = await http.json()
        except ValueError:
            raise HTTPException(400, "the body is not JSON") from None
        request = _request(body)
        created = int(time.time())
        if not body.get("stream"):
            with lock, running.labels(**labels).track_inprogress():
                served = served_one(request)(row.serve(request))
            return JSONResponse({"id": request.request_id, "object": "text_completion", "created": created,
                                 "model": model_id, "choices": [{"index": 0, "text": served.text,
                                                                 "finish_reason": served.stop_reason}],
                                 "usage": {"prompt_tokens": served.prompt_tokens,
                                           "completion_tokens": served.output_tokens,
                                           "total_tokens": served.prompt_tokens + served.output_tokens},
                                 "metrics": {"speculative_decoding": _spec_block(served)}})
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events: "queue.Queue" = queue.Queue()
        gone = threading.Event()

        def on_text(delta: str) -> bool:
            events.put(("text", delta))
            return not gone.is_set()

        def work() -> None:
            try:
                with lock, running.labels(**labels).track_inprogress():
                    events.put(("done", served_one(request)(row.serve(request, on_text=on_text))))
            except Exception as e:  # the stream says so, as vLLM's error event does
                events.put(("error", f"{type(e).__name__}: {e}"))

        async def stream():
            # Async, so that a client's going away cancels it at once (its `finally` tells the
            # engine, which ends the request at its next step); the engine runs in a thread.
            threading.Thread(target=work, daemon=True).start()
            try:
                while True:
                    kind, value = await asyncio.to_thread(events.get)
                    if kind == "text":
                        yield _chunk(request.request_id, created,
                                     choices=[{"index": 0, "text": value, "finish_reason": None}])
                    elif kind == "error":
                        yield "data: " + json.dumps({"error": {"message": value, "code": 500}}) + "\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        served = value
                        yield _chunk(request.request_id, created,
                                     choices=[{"index": 0, "text": "", "finish_reason": served.stop_reason}])
                        if usage:
                            yield _chunk(request.request_id, created, choices=[],
                                         usage={"prompt_tokens": served.prompt_tokens,
                                                "completion_tokens": served.output_tokens,
                                                "total_tokens": served.prompt_tokens + served.output_tokens},
                                         metrics={"speculative_decoding": _spec_block(served)})
                        yield "data: [DONE]\n\n"
                        return
            finally:
                gone.set()  # a client that went away: the engine ends the request at its next step

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def serve_http(row, port: int, model_id: str, root: str, host: str = "127.0.0.1") -> None:
    """Serve `row` on host:port until interrupted."""
    import uvicorn

    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("pytest-moeperf")
    except PackageNotFoundError:
        v = "unknown"
    row.prepare()
    uvicorn.run(make_app(row, model_id, root, v), host=host, port=port, log_level="warning")
