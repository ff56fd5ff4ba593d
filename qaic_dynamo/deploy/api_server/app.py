"""An OpenAI-compatible HTTP server over one ``LLM`` (FastAPI).

    app = build_app(LLM("path/to/model"), "my-model")
    uvicorn.run(app, host="127.0.0.1", port=8000)       # or: qaic-dynamo serve MODEL

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the chat template
of the model's tokenizer), each streaming server-sent events with ``"stream": true``;
``GET /v1/models``, ``GET /health`` and Prometheus ``GET /metrics``. Requests from every
client go to one scheduler (:mod:`.async_engine`). A bad request - an unknown model, a
prompt that does not fit ``max_model_len``, a bad sampling value, a malformed body - gets
a 400 with OpenAI's error body, naming the problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse

from qaic_dynamo.deploy.api_server.async_engine import AsyncEngine
from qaic_dynamo.deploy.api_server.metrics import ServerMetrics
from qaic_dynamo.deploy.api_server.protocol import ChatCompletionRequest, CompletionRequest
from qaic_dynamo.engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from qaic_dynamo.errors import BadRequestError, EngineStepError, SamplingParamsError

__all__ = ["build_app"]


def _error(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def _error_body(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse(_error(message, param, code, status), status_code=status)


class _Choice:
    """One choice accumulated from deltas."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def build_app(llm: LLM, model_name: str) -> FastAPI:
    """The app serving ``llm`` as ``model_name`` (see the module docstring)."""
    holder: dict[str, Any] = {}

    def on_finish(stream: Any, failed: str | None) -> None:
        holder["metrics"].on_finish(stream, failed)

    engine = AsyncEngine(llm, on_finish=on_finish, on_token=lambda n: holder["metrics"].on_token(n))
    metrics = ServerMetrics(model_name, engine)
    holder["metrics"] = metrics
    tokenizer = llm.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="qaic-dynamo", lifespan=lifespan)
    app.state.engine = engine
    app.state.llm = llm

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error_body(f"invalid request body: {where}: {first.get('msg', exc)}", where, "invalid_request")

    @app.exception_handler(EngineStepError)
    async def engine_failed(request: Request, exc: EngineStepError) -> JSONResponse:
        return _error_body(str(exc), None, "engine_error", 500)

    @app.exception_handler(BadRequestError)
    async def bad_request(request: Request, exc: BadRequestError) -> JSONResponse:
        return _error_body(str(exc), exc.param, exc.code, exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.dead is not None else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "qaic-dynamo",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def check_model(name: str) -> None:
        if name != model_name:
            raise BadRequestError(
                f"The model `{name}` does not exist; this server serves `{model_name}`", "model", "model_not_found"
            )

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise BadRequestError(
                "this model has no tokenizer, so prompts must be token ids (a list of ints)", "prompt", "no_tokenizer"
            )
        return list(tokenizer.encode(text))

    def params_of(make: Any) -> SamplingParams:
        try:
            return make()
        except SamplingParamsError as e:
            raise BadRequestError(str(e), None, "invalid_sampling_params") from None

    def checked(prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            llm.core.check_request(prompt_ids, params)
        except ValueError as e:
            raise BadRequestError(
                str(e), "prompt", "context_length_exceeded" if "max_model_len" in str(e) else None
            ) from None

    def token_text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else str(token)

    async def merged(runs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) of several requests, as they come."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in it:
                    await q.put((i, out))
                await q.put((i, None))
            except BaseException as e:  # delivered, then re-raised by the consumer
                await q.put((i, e))

        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(runs)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream whose engine step failed ends with OpenAI's error object and [DONE]."""
        try:
            async for event in events:
                yield event
        except EngineStepError as e:
            yield json.dumps(_error(str(e), None, "engine_error", 500))
            yield "[DONE]"

    def finish(requests: list[_Choice]) -> None:
        """Count each request once (by its first sample's finish reason)."""
        for c in requests:
            metrics.finished(c.finish_reason)

    def closing(body: Any, choices: list[_Choice], head: dict, usage: Any) -> list[str]:
        """A stream's last events: the usage chunk when asked for, then [DONE]."""
        finish(choices[:: max(1, body.n)])
        lines = []
        if body.stream_options is not None and body.stream_options.include_usage:
            lines.append(json.dumps({**head, "model": model_name, "choices": [], "usage": usage()}))
        return [*lines, "[DONE]"]

    # -- /v1/completions ---------------------------------------------------------------------
    def completion_logprobs(choice: _Choice, delta_ids: list[int], entries: list[dict], offset: int) -> dict:
        tokens = [token_text(t) for t in delta_ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e[t].logprob for t, e in zip(delta_ids, entries)],
            "top_logprobs": [{token_text(k): v.logprob for k, v in e.items()} for e in entries],
            "text_offset": offsets,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise BadRequestError("prompt is empty", "prompt")
        ids = [encode(p) if isinstance(p, str) else list(p) for p in prompts]
        params = params_of(lambda: body.sampling_params(body.max_tokens, body.logprobs))
        for p in ids:
            checked(p, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = params.n
        choices = [_Choice(i * n + k) for i in range(len(ids)) for k in range(n)]
        runs = [engine.generate(p if isinstance(p, str) else None, i, params) for p, i in zip(prompts, ids)]

        def usage() -> dict:
            completion = sum(len(c.token_ids) for c in choices)
            prompt = sum(len(p) for p in ids)
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        if not body.stream:
            async for i, out in merged(runs):  # one final, whole output per prompt
                for o in out.outputs:
                    choices[i * n + o.index].add(o)
            finish(choices[::n])
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": completion_logprobs(c, c.token_ids, c.logprobs, 0)
                        if body.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c in choices
                ],
                "usage": usage(),
            }

        async def events() -> AsyncIterator[str]:
            async for i, out in merged(runs):
                for o in out.outputs:
                    c = choices[i * n + o.index]
                    offset = len(c.text)
                    c.add(o)
                    if not o.text and not o.token_ids and o.finish_reason is None:
                        continue
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {
                                "index": c.index,
                                "text": o.text,
                                "logprobs": completion_logprobs(c, o.token_ids, o.logprobs or [], offset)
                                if body.logprobs is not None
                                else None,
                                "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                            }
                        ],
                    }
                    yield json.dumps(chunk)
            for line in closing(body, choices, {"id": rid, "object": "text_completion", "created": created}, usage):
                yield line

        return EventSourceResponse(guarded(events()), ping=3600)

    # -- /v1/chat/completions ----------------------------------------------------------------
    def chat_logprobs(delta_ids: list[int], entries: list[dict], top: int) -> dict:
        content = []
        for t, e in zip(delta_ids, entries):
            text = token_text(t)
            ranked = sorted(e.items(), key=lambda kv: kv[1].rank)[:top]
            content.append(
                {
                    "token": text,
                    "logprob": e[t].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": token_text(k), "logprob": v.logprob, "bytes": list(token_text(k).encode())}
                        for k, v in ranked
                    ],
                }
            )
        return {"content": content}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Any:
        check_model(body.model)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise BadRequestError(
                "this model's tokenizer has no chat template; use /v1/completions", "messages", "no_chat_template"
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that refuses these messages
            raise BadRequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        top = body.top_logprobs or 0
        params = params_of(lambda: body.sampling_params(body.max_new_tokens(), body.num_logprobs()))
        checked(ids, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = [_Choice(k) for k in range(params.n)]
        run = engine.generate(None, ids, params, prefix="chatcmpl", delta=body.stream)

        def usage() -> dict:
            completion = sum(len(c.token_ids) for c in choices)
            return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}

        if not body.stream:
            async for out in run:  # one final, whole output
                for o in out.outputs:
                    choices[o.index].add(o)
            finish(choices[:1])
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs, top) if body.logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c in choices
                ],
                "usage": usage(),
            }

        def chunk(choice: dict) -> str:
            return json.dumps(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }
            )

        async def events() -> AsyncIterator[str]:
            for c in choices:
                yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            async for out in run:
                for o in out.outputs:
                    choices[o.index].add(o)
                    if not o.text and not o.token_ids and o.finish_reason is None:
                        continue
                    yield chunk(
                        {
                            "index": o.index,
                            "delta": {"content": o.text} if o.text else {},
                            "logprobs": chat_logprobs(o.token_ids, o.logprobs or [], top) if body.logprobs else None,
                            "finish_reason": o.finish_reason,
                        }
                    )
            for line in closing(
                body, choices, {"id": rid, "object": "chat.completion.chunk", "created": created}, usage
            ):
                yield line

        return EventSourceResponse(guarded(events()), ping=3600)

    return app
