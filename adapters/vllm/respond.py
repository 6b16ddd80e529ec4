"""The API server's part of the return channel: a response middleware that adds a ``dmi`` field.

vLLM's OpenAI server has no hook for extra response fields; ASGI middleware is its supported
extension point (``vllm serve --middleware dmi.adapters.vllm.respond.ReturnMiddleware``, a flag of
0.25 and 0.32 alike). It touches only ``POST .../completions`` bodies whose ``vllm_xargs`` ask for
``dmi_return`` (or ``dmi`` holding ``return``); every other request passes through untouched.

For those it mints a token (``secrets.token_hex``) the request carries to the engine in its extra
args (:data:`TOKEN_KEY`, a key only the middleware sets: a client's own value is refused with
HTTP 400, and the request validation refuses a token this process did not mint). The engine keys
its files by that token (:mod:`.returns`), so a client that reuses another's request id (the
``X-Request-Id`` header) never reads another's values. While the response is in flight a marker
``{token}.live`` exists; once the server answered, the middleware removes it, then puts each
choice's file under ``"dmi"`` and deletes the request's files, whatever the outcome (an error, a
client that went away). The engine deletes a file it wrote after the marker went (a step that ran
while the request was aborted), so none outlives its request; a sweep removes any file older than
:data:`MAX_AGE_S` (a server killed mid-request) while the server runs. Which choice: the response's
``id`` with vLLM's suffixes (``{id}-{prompt}``, ``{sample}_{id}-{prompt}`` for ``n > 1``).
A streamed request that asks is refused (HTTP 400): the field comes with the whole response only.
What may be asked is the operator's (``requests.return``); request validation refuses the rest.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import time

from .returns import TOKEN_KEY, choice_file, live_marker

MIDDLEWARE = "dmi.adapters.vllm.respond.ReturnMiddleware"
MAX_AGE_S = 600          # a return file older than this (its request long gone) is swept
SWEEP_EVERY_S = 60
_state = {"instances": 0, "folder": None, "sweeping": False}
_live: set[str] = set()  # tokens of this process's requests in flight


def installed() -> bool:
    """Whether this process's server runs the middleware."""
    return _state["instances"] > 0


def bind(folder) -> None:
    """The return folder of this process's engine (:func:`compat.return_dir`, set where the request
    validation is built)."""
    _state["folder"] = folder


def minted(token) -> bool:
    """Whether ``token`` is one this process's middleware gave a request now in flight."""
    return isinstance(token, str) and token in _live


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


def collect(body, n: int, token: str):
    """``body`` (an OpenAI response) with each choice's returned captures under ``dmi``: the files
    the engine wrote under ``token``."""
    folder = _state["folder"]
    if not isinstance(body, dict) or folder is None:
        return body
    for choice in body.get("choices") or []:
        got = None
        for rid in candidates(str(body.get("id", "")), int(choice.get("index", 0)), n):
            path = folder / choice_file(token, rid)
            try:
                got = json.loads(path.read_text())
                break
            except (OSError, ValueError):
                continue
        choice["dmi"] = got if got is not None else {"error": "no captures came back for this choice"}
    return body


def unmark(token: str) -> None:
    """The request's response is over: its marker goes (the engine deletes what it writes after)."""
    _live.discard(token)
    folder = _state["folder"]
    if folder is None:
        return
    try:
        os.unlink(folder / live_marker(token))
    except OSError:
        pass


def forget(token: str) -> None:
    """Remove the request's marker and every file of its token (the marker first)."""
    unmark(token)
    folder = _state["folder"]
    if folder is None:
        return
    try:
        names = [e.name for e in os.scandir(folder) if e.name.startswith(token + ".")]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(folder / name)
        except OSError:
            pass


def sweep(now: float | None = None) -> int:
    """Delete return files older than :data:`MAX_AGE_S` (not those of this process's requests in
    flight, nor another's markers); returns how many."""
    folder, now, gone = _state["folder"], time.time() if now is None else now, 0
    if folder is None:
        return 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for e in entries:
        if e.name.endswith(".live") or e.name.split(".", 1)[0] in _live:
            continue
        try:
            if now - e.stat().st_mtime > MAX_AGE_S:
                os.unlink(e.path)
                gone += 1
        except OSError:
            pass
    return gone


def _sweep_later() -> None:
    """Sweep every :data:`SWEEP_EVERY_S` on the server's event loop (started with its first request
    that asks: an idle server keeps no file past the bound either)."""
    if _state["sweeping"]:
        return
    _state["sweeping"] = True
    loop = asyncio.get_running_loop()

    def tick():
        sweep()
        loop.call_later(SWEEP_EVERY_S, tick)
    loop.call_later(SWEEP_EVERY_S, tick)


def _error(message: str, param: str = "vllm_xargs.dmi_return") -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


async def _refuse(send, data: bytes) -> None:
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


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
        if not isinstance(body, dict):
            return await self.app(scope, replay, send)
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and TOKEN_KEY in xargs:
            return await _refuse(send, _error(f"dmi: refused: vllm_xargs.{TOKEN_KEY} is set by the server only; "
                                              "drop it from the request", f"vllm_xargs.{TOKEN_KEY}"))
        if not asks_return(body):
            return await self.app(scope, replay, send)
        if body.get("stream"):
            return await _refuse(send, _error("dmi: refused: returned captures come with a whole response only; "
                                              "leave stream out or drop dmi_return"))
        folder = _state["folder"]
        token = secrets.token_hex(16)
        if folder is not None:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            (folder / live_marker(token)).touch()
        _live.add(token)
        _sweep_later()
        raw = json.dumps({**body, "vllm_xargs": {**xargs, TOKEN_KEY: token}}).encode()
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                 + [(b"content-length", str(len(raw)).encode())]}
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
                unmark(token)          # (before reading: see the module's doc)
                try:
                    data = json.dumps(collect(json.loads(data), int(body.get("n") or 1), token)).encode()
                except (ValueError, TypeError):
                    pass
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        try:
            await self.app(scope, replay, held)
        finally:
            forget(token)
