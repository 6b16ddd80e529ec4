"""Quantities dmi computes from forward variables when the engine does not materialize them."""
from __future__ import annotations

import torch


def attention_pattern(query: torch.Tensor, key: torch.Tensor, mask, scaling: float, groups: int,
                      sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention weights, computed exactly as HF's eager attention does.

    query: [batch, head, q_seq, head_dim]; key: [batch, kv_head, k_seq, head_dim] (after the cache
    update, so k_seq counts every key); mask: HF's additive float mask, a boolean mask (sdpa), or
    None (causal). scaling: the factor of q k^T (``1/sqrt(head_dim)``, or what the family uses,
    e.g. Gemma's ``query_pre_attn_scalar ** -0.5``); groups: query heads per kv head;
    sliding_window: the layer's window where ``mask`` is None (else the mask holds it); softcap:
    the logits' tanh soft cap (Gemma 2's ``attn_logit_softcapping``: ``softcap * tanh(x / softcap)``
    before the mask), None for none. Returns [batch, head, q_seq, k_seq].
    """
    if groups > 1:
        b, h, s, d = key.shape
        key = key[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:        # the order of eager attention's ops, so the weights match bit for bit
        weights = weights / softcap
        weights = torch.tanh(weights)
        weights = weights * softcap
    if mask is None:
        q_len, k_len = query.shape[-2], key.shape[-2]
        i = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        j = torch.arange(k_len, device=query.device)[None, :]
        allowed = j <= i
        if sliding_window is not None:
            allowed &= j > i - sliding_window
        mask = allowed
    if mask.dtype == torch.bool:
        weights = weights.masked_fill(~mask, torch.finfo(weights.dtype).min)
    elif isinstance(mask, torch.Tensor):
        weights = weights + mask[..., : key.shape[-2]]
    else:
        raise TypeError(f"attn.pattern cannot read an attention mask of type {type(mask).__name__}; "
                        "load the model with attn_implementation='sdpa' or 'eager'")
    return torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)


DERIVED = {"attention_pattern": attention_pattern}
