"""Pictures of a capture: an attention pattern, residual norms per layer, a logit lens.

    tree = run.result()                      # or dmi.open("out.zarr")
    dmi.plot.attention(tree, request="r0", layer=1, head=0, tokenizer=tok, out="attn.png")
    dmi.plot.resid_norms(tree, out="norms.png")
    dmi.plot.logit_lens(tree, model, request="r0", tokenizer=tok, out="lens.png")

Each function returns a ``matplotlib.figure.Figure`` (shown inline in a notebook) and, with
``out``, writes it as a PNG of ``figsize`` x ``DPI`` pixels. Token text on the axes comes from the
store's ``token_id`` coordinate (through ``tokenizer``, else the ids) where the store has one,
else from the positions. Needs matplotlib (``pip install dmi[plot]``); figures are drawn without
pyplot, so no backend is chosen for the caller.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import DmiError


DPI = 100
MAX_LABELS = 64          # tick labels on an axis; a longer axis gets every n-th


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise DmiError("dmi.plot needs matplotlib. Fix: pip install 'dmi[plot]' (or pip install matplotlib)") from None
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(fig, out) -> None:
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI, format="png")


def _group(tree, path: str, what: str):
    try:
        return tree[path].to_dataset(inherit=False)
    except KeyError:
        have = ", ".join(n.path.strip("/") for n in tree.subtree if n.dataset.data_vars) or "none"
        raise DmiError(f"dmi.plot.{what}: the capture has no {path!r} group (groups: {have}). Fix: capture the "
                       f"site (hook spec: capture: [{{sites: [{path.rsplit('/', 1)[-1].replace('/', '.')}]}}])") from None


def request_rows(ds, request: str | None, what: str):
    """The rows of one request (the first request when None), in position order (each position once)."""
    requests = ds["request"].values.astype(object)
    if not len(requests):
        raise DmiError(f"dmi.plot.{what}: the group holds no rows. Fix: capture some tokens first")
    if request is None:
        request = requests[0]
    idx = np.flatnonzero(requests == str(request))
    if not len(idx):
        have = ", ".join(dict.fromkeys(requests.tolist()))
        raise DmiError(f"dmi.plot.{what}: request {request!r} is not in the capture (requests: {have}). "
                       f"Fix: pass one of them")
    pos = ds["position"].values[idx]
    _, first = np.unique(pos, return_index=True)       # sorted positions, each once
    return ds.isel(token=idx[first]), str(request)


def token_labels(rows, tokenizer=None) -> dict[int, str]:
    """position -> label of the rows: the token's text (``token_id`` coordinate and a tokenizer),
    its id (``token_id`` alone), else the position."""
    positions = rows["position"].values.astype(int).tolist()
    if "token_id" not in rows.variables:
        return {p: str(p) for p in positions}
    ids = rows["token_id"].values.astype(int).tolist()
    if tokenizer is None:
        return {p: str(i) for p, i in zip(positions, ids)}
    return {p: printable(tokenizer.decode([i])) for p, i in zip(positions, ids)}


def printable(text: str) -> str:
    """A token's text as a label: control characters (byte tokens) as escapes, no font lacks them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _ticks(ax_set_ticks, ax_set_labels, labels: list[str], rotation: int = 0) -> None:
    every = max(1, -(-len(labels) // MAX_LABELS))
    ticks = list(range(0, len(labels), every))
    ax_set_ticks(ticks)
    ax_set_labels([labels[t] for t in ticks], rotation=rotation, fontsize=7)


def attention(tree, request: str | None = None, layer: int = 0, head: int = 0, *, tokenizer=None, out=None):
    """The attention pattern of one request, layer and head: queries (rows) by keys (columns),
    from the ``layers/attn/pattern`` group; key columns are positions."""
    ds = _group(tree, "layers/attn/pattern", "attention")
    rows, request = request_rows(ds, request, "attention")
    pattern = rows["pattern"]
    layers = pattern["layer"].values.tolist()
    if layer not in layers:
        raise DmiError(f"dmi.plot.attention: layer {layer} is not captured (layers: {layers}). Fix: pass one of them")
    pattern = pattern.sel(layer=layer)
    heads = pattern["head"].values.tolist() if "head" in pattern.coords else list(range(pattern.sizes["head"]))
    if head not in heads:
        raise DmiError(f"dmi.plot.attention: head {head} is not captured (heads: {heads}). Fix: pass one of them")
    values = pattern.isel(head=heads.index(head)).values.astype(np.float32)     # [query rows, key positions]
    positions = rows["position"].values.astype(int)
    n_keys = min(values.shape[1], int(positions.max()) + 1)
    values = values[:, :n_keys]
    labels = token_labels(rows, tokenizer)
    size = min(14.0, 3.0 + 0.22 * max(len(positions), n_keys))
    fig = _figure(size + 1.0, size)
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    _ticks(ax.set_yticks, ax.set_yticklabels, [labels[p] for p in positions.tolist()])
    _ticks(ax.set_xticks, ax.set_xticklabels, [labels.get(k, str(k)) for k in range(n_keys)], rotation=90)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"attention: {request}, layer {layer}, head {head}")
    fig.colorbar(im, ax=ax, shrink=0.8)
    _save(fig, out)
    return fig


def resid_norms(tree, *, site: str = "resid_post", out=None):
    """The mean L2 norm of the residual stream per layer, one line per request (at most 16)."""
    ds = _group(tree, f"layers/{site}", "resid_norms")
    values = ds[site]
    layers = values["layer"].values
    if "hidden" in values.dims:
        norms = np.sqrt((values.values.astype(np.float32) ** 2).sum(-1))      # [token, layer]
    else:                                     # stored as a norm already (reduce: {norm: true})
        norms = values.values.astype(np.float32).reshape(values.shape[0], len(layers))
    requests = ds["request"].values.astype(object)
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    for r in list(dict.fromkeys(requests.tolist()))[:16]:
        ax.plot(layers, np.nanmean(norms[requests == r], axis=0), marker="o", label=r)
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"mean |{site}|")
    ax.set_title(f"{site} norm per layer")
    ax.legend(fontsize=7)
    _save(fig, out)
    return fig


def lens_values(tree, model, request: str | None = None, *, k: int = 5):
    """The logit lens of one request: each layer's ``resid_post`` through the model's final norm
    and unembedding (the modules its architecture spec names for ``final_norm`` and ``logits``).
    Returns an ``xarray.Dataset`` of ``top_id`` and ``top_prob`` [layer, position, k] (softmax
    probabilities, computed in float32)."""
    import torch
    import xarray as xr

    from .spec import find_arch_spec
    ds = _group(tree, "layers/resid_post", "logit_lens")
    rows, request = request_rows(ds, request, "logit_lens")
    arch = find_arch_spec(getattr(model.config, "model_type", None))
    norm = model.get_submodule(arch.data["sites"]["final_norm"]["hf"]["module"])
    unembed = model.get_submodule(arch.data["sites"]["logits"]["hf"]["module"])
    param = next(model.parameters())
    resid = rows["resid_post"]                 # [token, layer, hidden]
    ids, probs = [], []
    with torch.no_grad():
        for li in range(resid.sizes["layer"]):
            x = torch.from_numpy(np.ascontiguousarray(resid.isel(layer=li).values.astype(np.float32)))
            logits = unembed(norm(x.to(param.device, param.dtype)[None]))[0].float()
            p = torch.softmax(logits, dim=-1)
            top = torch.topk(p, k, dim=-1)
            ids.append(top.indices.cpu().numpy())
            probs.append(top.values.cpu().numpy())
    coords = {"layer": resid["layer"].values, "position": rows["position"].values}
    out = xr.Dataset({"top_id": (("layer", "position", "k"), np.stack(ids)),
                      "top_prob": (("layer", "position", "k"), np.stack(probs))}, coords=coords)
    out.attrs["request"] = request
    if "token_id" in rows.variables:
        out["token_id"] = ("position", rows["token_id"].values)
    return out


def logit_lens(tree, model, request: str | None = None, *, tokenizer=None, out=None):
    """A logit lens picture: per layer (rows) and position (columns) the top-1 token of
    :func:`lens_values` (its text with ``tokenizer``, else its id), colored by its probability."""
    lens = lens_values(tree, model, request, k=1)
    top_id, top_prob = lens["top_id"].values[..., 0], lens["top_prob"].values[..., 0]
    n_layers, n_pos = top_id.shape
    fig = _figure(min(20.0, 2.5 + 0.7 * n_pos), min(14.0, 2.5 + 0.4 * n_layers))
    ax = fig.add_subplot()
    vmax = float(np.nanmax(top_prob)) if top_prob.size else 1.0      # (a random model's are all small)
    im = ax.imshow(top_prob, cmap="magma", vmin=0.0, vmax=vmax, aspect="auto", origin="lower",
                   interpolation="nearest")
    text = (lambda i: printable(tokenizer.decode([int(i)]))) if tokenizer is not None else str
    if n_pos * n_layers <= 1200:                # the words fit
        for li in range(n_layers):
            for pi in range(n_pos):
                ax.text(pi, li, text(top_id[li, pi])[:8], ha="center", va="center", fontsize=6,
                        color="white" if top_prob[li, pi] < 0.5 * vmax else "black")
    rows = tree["layers/resid_post"].to_dataset(inherit=False)
    labels = token_labels(request_rows(rows, lens.attrs["request"], "logit_lens")[0], tokenizer)
    _ticks(ax.set_xticks, ax.set_xticklabels, [labels[p] for p in lens["position"].values.astype(int).tolist()],
           rotation=90)
    _ticks(ax.set_yticks, ax.set_yticklabels, [str(x) for x in lens["layer"].values.tolist()])
    ax.set_xlabel("input token (position)")
    ax.set_ylabel("layer")
    ax.set_title(f"logit lens: {lens.attrs['request']}, top-1 next token")
    fig.colorbar(im, ax=ax, shrink=0.8, label="probability")
    _save(fig, out)
    return fig
