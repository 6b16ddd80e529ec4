"""The engine's part of the return channel: small captures a request asks back (``requests.return``).

A request that asks (``extra_args["dmi"]["return"]``, checked where it came in) and carries the
token the API server's response middleware minted for it (:data:`TOKEN_KEY`, :mod:`.respond`)
gets, after each step that sampled a token for it, the operator's items computed from that step
and written as one small JSON file ``{token}.{hash of its request id}.json`` in the server's
return folder (:func:`compat.return_dir`); the middleware puts it into the response and deletes
it. A request without a token (one that did not come through the middleware) gets nothing. Each
step overwrites the last, so the response carries the values of the request's last sampled token.
Written before ``execute_model`` returns: before vLLM hands the step's tokens on, hence before
the response is built. A file written once the middleware removed the request's marker
(``{token}.live``: the response is over, or its client went away and vLLM is aborting it) is
deleted here at once.

Items: ``top_logits: k``: the k largest logits (and their token ids) of the last sampled token,
the same values the store's ``logits`` site holds for that row; ``probes``: each of the operator's
linear probes (:mod:`.probes`) of the last sampled token's row, computed in the forward.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import numpy as np
import torch

from . import compat
from .policy import TOKEN_KEY, RequestRefused, options
_TOKEN = re.compile(r"^[0-9a-f]{32}$")


def choice_file(token: str, request_id: str) -> str:
    """The file of one engine request (its caller's id: :func:`compat.external_request_id`)."""
    return f"{token}.{hashlib.sha256(request_id.encode()).hexdigest()[:24]}.json"


def live_marker(token: str) -> str:
    """The marker the middleware keeps while a request's response is in flight."""
    return f"{token}.live"


def token_of(extra_args) -> str | None:
    """The middleware's token of a request (None: it has none, or not one of the middleware's form)."""
    t = (extra_args or {}).get(TOKEN_KEY)
    return t if isinstance(t, str) and _TOKEN.match(t) else None


class StepReturns:
    """Per step: which requests of the batch asked for returns, and their values after the step."""

    def __init__(self, policy, runner, model, folder, read_args, probes=None):
        self.offers = dict(policy.returns)
        self.probes = probes if probes else None
        self.runner, self.folder, self._read = runner, folder, read_args
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.asked: dict[str, tuple] = {}          # request id -> (token, the items it asked for) (() none)
        self._logits = None
        self._rows: list[tuple[int, int, str, int]] = []     # (logits row, token row, request id, position)
        self._unwrap = compat.wrap_compute_logits(model, self._on_logits)

    def _items(self, req_id: str) -> tuple:
        got = self.asked.get(req_id)
        if got is None:
            extra = self._read(self.runner, req_id)
            try:
                wanted = (options(extra) or {}).get("return") or []
            except RequestRefused:
                wanted = []
            token = token_of(extra)
            if not isinstance(wanted, list) or token is None:
                wanted = []
            items = tuple(sorted(self.offers if "*" in wanted else set(wanted) & set(self.offers)))
            got = self.asked[req_id] = (token, items)
        return got[1]

    def begin(self, batch, last=None) -> None:
        """The step's requests whose row this step is sampled: ``batch`` (a :class:`compat.Batch`),
        or None for ``last`` (request ids) decoding one token further."""
        self._logits = None
        if batch is None:
            self._rows = [(j, t, rid, pos + 1) for j, t, rid, pos in self._rows]
            return
        for rid in batch.finished:
            self.asked.pop(rid, None)
        end = batch.num_computed + batch.num_scheduled            # positions computed after this step
        token_end = np.cumsum(batch.num_scheduled)                 # the step's token rows, request by request
        self._rows = [(j, int(token_end[j]) - 1, rid, int(end[j]) - 1) for j, rid in enumerate(batch.req_ids)
                      if self._items(rid) and end[j] >= batch.num_prompt[j]]

    def _on_logits(self, logits: torch.Tensor) -> None:
        self._logits = logits

    def end(self) -> None:
        logits, self._logits = self._logits, None
        if logits is None or not self._rows:
            return
        k = int(self.offers.get("top_logits", 0))
        top = probed = None
        if k and any("top_logits" in self.asked[rid][1] for _, _, rid, _ in self._rows):
            rows = torch.tensor([j for j, _, _, _ in self._rows], device=logits.device)
            values, ids = torch.topk(logits[rows].float(), min(k, logits.shape[-1]), dim=-1)
            top = values.cpu().numpy(), ids.cpu().numpy()
        if self.probes is not None and any("probes" in self.asked[rid][1] for _, _, rid, _ in self._rows):
            rows = torch.tensor([t for _, t, _, _ in self._rows], device=next(iter(self.probes.by_name.values())).out.device)
            probed = {name: p.values(rows) for name, p in self.probes.by_name.items()}
        for n, (_, _, rid, pos) in enumerate(self._rows):
            token, items = self.asked[rid]
            out = {"position": pos}
            if top is not None and "top_logits" in items:
                out["top_logits"] = {"token_ids": top[1][n].tolist(),
                                     "logits": [float(v) for v in np.asarray(top[0][n], np.float32)]}
            if probed is not None and "probes" in items:
                out["probes"] = {name: (float(v[n][0]) if self.probes.by_name[name].plan.vector
                                        else [float(x) for x in v[n]]) for name, v in probed.items()}
            self._write(token, compat.external_request_id(rid), out)

    def _write(self, token: str, request_id: str, out: dict) -> None:
        path = self.folder / choice_file(token, request_id)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(out))
            os.replace(tmp, path)          # the middleware never reads half a file
            if not (self.folder / live_marker(token)).exists():
                path.unlink(missing_ok=True)          # its response is over (see the module's doc)
        except OSError:                    # (the middleware removed the request's files meanwhile)
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        self._unwrap()
        shutil.rmtree(self.folder, ignore_errors=True)
