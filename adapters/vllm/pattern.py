"""``attn.pattern`` on vLLM: attention weights recomputed from q and the request's keys.

vLLM's attention kernels never materialize the weights, and the keys of earlier steps live in its
paged KV cache, whose layout is backend-specific. dmi keeps its own copy of the keys of the
*observed* layers instead (after RoPE, per request, grown as the request advances, dropped when it
finishes) and recomputes ``softmax(q k^T * scaling)`` for the rows the site selected, exactly as
HF's eager attention does (float32 softmax, causal and within the layer's sliding window if it has
one, key columns = key positions 0..max_keys-1).

The patched attention forward calls ``dmi_vllm::attention_pattern`` (an opaque custom op: no graph
break under torch.compile) right after ``self.attn(q, k, v)``; it returns ``[num_tokens, head,
max_keys]`` with the selected rows filled, which the site's capture op then copies like any site.
Keys of positions a request never computed (prefix-cache hits) are unknown to dmi, so the adapter
refuses ``attn.pattern`` while prefix caching is on.
"""
from __future__ import annotations

import numpy as np
import torch

SESSIONS_BY_RUN: dict[int, object] = {}      # run id -> worker.Session


@torch.library.custom_op("dmi_vllm::attention_pattern", mutates_args=())
def attention_pattern_op(query: torch.Tensor, key: torch.Tensor, run: int, site: int, scaling: float,
                         heads: int, max_keys: int, window: int) -> torch.Tensor:
    session = SESSIONS_BY_RUN.get(run)
    if session is None:
        return query.new_zeros(query.shape[0], heads, max_keys)
    return session.keys.pattern(session.run, site, query, key, scaling, heads, max_keys, window)


@attention_pattern_op.register_fake
def _fake(query, key, run, site, scaling, heads, max_keys, window):
    return query.new_empty(query.shape[0], heads, max_keys)


def sliding_window(layer) -> int:
    """The attention window of a vLLM attention module (its ``attn``'s), 0 for none."""
    return getattr(getattr(layer, "attn", None), "sliding_window", None) or 0


def vllm_attention_pattern(query, key, scaling, layer):
    """Called by the patched forward (``__dmi_compute__``): the op, with this layer's constants."""
    handle = layer._dmi_sites["attn.pattern"]
    heads, max_keys, window = layer._dmi_pattern
    return torch.ops.dmi_vllm.attention_pattern(query, key, handle.run, handle.site, float(scaling), heads, max_keys,
                                                window)


class KeyStore:
    """Keys after RoPE of the observed layers, per request: ``[positions, kv_head, head_dim]``."""

    def __init__(self):
        self.keys: dict[tuple[int, int], torch.Tensor] = {}     # (site, request index) -> buffer
        self.length: dict[tuple[int, int], int] = {}

    def forget(self, request_indices) -> None:
        for k in [k for k in self.keys if k[1] in request_indices]:
            del self.keys[k]
            self.length.pop(k, None)

    def _store(self, site: int, req: int, pos: np.ndarray, k: torch.Tensor) -> None:
        key = (site, req)
        need = int(pos.max()) + 1
        buf = self.keys.get(key)
        if buf is None or buf.shape[0] < need:
            grown = k.new_zeros(max(need, 2 * (buf.shape[0] if buf is not None else 64)), *k.shape[1:])
            if buf is not None:
                grown[: buf.shape[0]] = buf
            buf = self.keys[key] = grown
        buf[torch.from_numpy(pos).to(buf.device)] = k
        self.length[key] = max(self.length.get(key, 0), need)

    def pattern(self, run, site: int, query: torch.Tensor, key: torch.Tensor, scaling: float, heads: int,
                max_keys: int, window: int = 0) -> torch.Tensor:
        """``window``: the layer's sliding window (a query at position p sees keys p-window+1..p), 0 for none."""
        out = query.new_zeros(query.shape[0], heads, max_keys)
        ctrl = run.ring.current
        if ctrl is None or ctrl.ended:
            return out                                       # warm-up / profiling forward: not a step
        st = ctrl.tokens
        head_dim = query.shape[-1] // heads
        kv = key.detach().reshape(key.shape[0], -1, head_dim)
        # every computed row's key, for this and later steps' queries
        for req in np.unique(st.request):
            at = np.nonzero(st.request == req)[0]
            self._store(site, int(req), st.position[at], kv[torch.from_numpy(st.rows[at]).to(kv.device)])
        slot = ctrl.slots.get(site)
        if slot is None:
            return out
        q = query.detach().reshape(query.shape[0], heads, head_dim)
        sel = slot.sel
        for req in np.unique(st.request[sel]):
            at = sel[st.request[sel] == req]
            rows = torch.from_numpy(st.rows[at]).to(q.device)
            pos = torch.from_numpy(st.position[at]).to(q.device)
            n_keys = int(st.position[at].max()) + 1
            keys = self.keys[(site, int(req))][:n_keys]                         # [keys, kv_head, head_dim]
            groups = heads // keys.shape[1]
            keys = keys.repeat_interleave(groups, dim=1)                         # [keys, head, head_dim]
            scores = torch.einsum("nhd,khd->nhk", q[rows], keys) * scaling       # [rows, head, keys]
            j = torch.arange(n_keys, device=q.device)[None, :]
            seen = j <= pos[:, None]
            if window:
                seen &= j > pos[:, None] - window
            scores = scores.masked_fill(~seen[:, None, :], torch.finfo(scores.dtype).min)
            w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[rows, :, : min(n_keys, max_keys)] = w[..., :max_keys]
        return out
