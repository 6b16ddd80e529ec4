"""The engine's part of the return channel: small captures a request asks back (``requests.return``).

A request that asks (``extra_args["dmi"]["return"]``, checked where it came in) gets, after each
step that sampled a token for it, the operator's items computed from that step and written as one
small JSON file named by a hash of its request id in the server's return folder
(:func:`compat.return_dir`); the API server's response middleware (:mod:`.respond`) puts it into
the response and deletes it. Each step overwrites the last, so the response carries the values of
the request's last sampled token. Written before ``execute_model`` returns: before vLLM hands the
step's tokens on, hence before the response is built.

Items: ``top_logits: k``: the k largest logits (and their token ids) of the last sampled token,
the same values the store's ``logits`` site holds for that row.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import torch

from . import compat
from .policy import RequestRefused, options


def file_name(request_id: str) -> str:
    """The file of an engine request (its caller's id: :func:`compat.external_request_id`)."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:32] + ".json"


class StepReturns:
    """Per step: which requests of the batch asked for returns, and their values after the step."""

    def __init__(self, policy, runner, model, folder, read_args):
        self.offers = dict(policy.returns)
        self.runner, self.folder, self._read = runner, folder, read_args
        folder.mkdir(parents=True, exist_ok=True)
        self.asked: dict[str, tuple] = {}          # request id -> the items it asked for (() none)
        self._logits = None
        self._rows: list[tuple[int, str, int]] = []     # (logits row, request id, position) of this step
        self._unwrap = compat.wrap_compute_logits(model, self._on_logits)

    def _items(self, req_id: str) -> tuple:
        got = self.asked.get(req_id)
        if got is None:
            try:
                wanted = (options(self._read(self.runner, req_id)) or {}).get("return") or []
            except RequestRefused:
                wanted = []
            if not isinstance(wanted, list):
                wanted = []
            got = self.asked[req_id] = tuple(sorted(self.offers if "*" in wanted else set(wanted) & set(self.offers)))
        return got

    def begin(self, batch, last=None) -> None:
        """The step's requests whose row this step is sampled: ``batch`` (a :class:`compat.Batch`),
        or None for ``last`` (request ids) decoding one token further."""
        self._logits = None
        if batch is None:
            self._rows = [(j, rid, pos + 1) for j, rid, pos in self._rows]
            return
        for rid in batch.finished:
            self.asked.pop(rid, None)
        end = batch.num_computed + batch.num_scheduled            # positions computed after this step
        self._rows = [(j, rid, int(end[j]) - 1) for j, rid in enumerate(batch.req_ids)
                      if self._items(rid) and end[j] >= batch.num_prompt[j]]

    def _on_logits(self, logits: torch.Tensor) -> None:
        self._logits = logits

    def end(self) -> None:
        logits, self._logits = self._logits, None
        if logits is None or not self._rows:
            return
        k = int(self.offers.get("top_logits", 0))
        rows = torch.tensor([j for j, _, _ in self._rows], device=logits.device)
        top = None
        if k:
            values, ids = torch.topk(logits[rows].float(), min(k, logits.shape[-1]), dim=-1)
            top = values.cpu().numpy(), ids.cpu().numpy()
        for n, (_, rid, pos) in enumerate(self._rows):
            out = {"position": pos}
            if top is not None and "top_logits" in self._items(rid):
                out["top_logits"] = {"token_ids": top[1][n].tolist(),
                                     "logits": [float(v) for v in np.asarray(top[0][n], np.float32)]}
            path = self.folder / file_name(compat.external_request_id(rid))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(out))
            os.replace(tmp, path)          # the middleware never reads half a file

    def close(self) -> None:
        self._unwrap()
        shutil.rmtree(self.folder, ignore_errors=True)
