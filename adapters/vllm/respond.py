"""The API server's part of the return channel: a response middleware that adds a ``dmi`` field.

vLLM's OpenAI server has no hook for extra response fields; ASGI middleware is its supported
extension point (``vllm serve --middleware dmi.adapters.vllm.respond.ReturnMiddleware``, a flag of
0.25 and 0.32 alike). It touches only ``POST .../completions`` bodies whose ``vllm_xargs`` ask for
``dmi_return`` (or ``dmi`` holding ``return``); every other request passes through untouched.

For those, once the server answered 200, each choice gets ``"dmi": {...}``: the file the engine
wrote for the choice's engine request (:mod:`.returns`), read and deleted. Which request: the
response's ``id`` with vLLM's suffixes (``{id}-{prompt}``, ``{sample}_{id}-{prompt}`` for ``n > 1``).
A streamed request that asks is refused (HTTP 400): the field comes with the whole response only.
What may be asked is the operator's (``requests.return``); request validation refuses the rest.
"""
from __future__ import annotations

import json

from .returns import file_name

MIDDLEWARE = "dmi.adapters.vllm.respond.ReturnMiddleware"
_state = {"instances": 0, "folder": None}


def installed() -> bool:
    """Whether this process's server runs the middleware."""
    return _state["instances"] > 0


def bind(folder) -> None:
    """The return folder of this process's engine (:func:`compat.return_dir`, set where the request
    validation is built)."""
    _state["folder"] = folder


def asks_return(body: dict) -> bool:
    from .policy import RequestRefused, options
    try:
        opts = options(body.get("vllm_xargs")) or {}
    except RequestRefused:
        return False                 # (validation answers it)
    return bool(opts.get("return"))


def candidates(response_id: str, index: int, n: int) -> list[str]:
    """Engine request ids (without vLLM's random suffix) that may have produced choice ``index``."""
    prompt, sample = divmod(index, max(n, 1))
    if n > 1:
        return [f"{sample}_{response_id}-{prompt}", f"{sample}_{response_id}"]
    return [f"{response_id}-{prompt}", response_id]


def collect(body: dict, n: int) -> dict:
    """``body`` (an OpenAI response) with each choice's returned captures under ``dmi``."""
    folder = _state["folder"]
    for choice in body.get("choices") or []:
        got = None
        for rid in candidates(str(body.get("id", "")), int(choice.get("index", 0)), n):
            path = folder / file_name(rid) if folder is not None else None
            if path is not None and path.exists():
                got = json.loads(path.read_text())
                path.unlink(missing_ok=True)
                break
        choice["dmi"] = got if got is not None else {"error": "no captures came back for this choice"}
    return body


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "vllm_xargs.dmi_return",
                                 "code": 400}}).encode()


class ReturnMiddleware:
    """Pure ASGI middleware (the response body is rewritten once it is complete)."""

    def __init__(self, app):
        self.app = app
        _state["instances"] += 1

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        try:
            body = json.loads(raw) if b"dmi" in raw else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or not asks_return(body):
            return await self.app(scope, replay, send)
        if body.get("stream"):
            data = _error("dmi: refused: returned captures come with a whole response only; leave stream out "
                          "or drop dmi_return")
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        start, parts = {}, []

        async def held(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            data = b"".join(parts)
            if start.get("status") == 200:
                try:
                    data = json.dumps(collect(json.loads(data), int(body.get("n") or 1))).encode()
                except ValueError:
                    pass
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, replay, held)
