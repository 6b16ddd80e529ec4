"""perf/online.py's tables: the paired TPOT ratio (each request against itself on vanilla)."""
from __future__ import annotations

import argparse
import os
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import online  # noqa: E402


def _window(config, rep, tpots):
    return {"config": config, "rate": 16.0, "repeat": rep, "sent": len(tpots), "done": len(tpots),
            "ttft_p50": 20.0, "ttft_p99": 40.0, "tpot_p50": float(np.median(tpots)), "tpot_p99": max(tpots),
            "out_tok_s": 1000.0, "tpot_by_request": {str(i): t for i, t in enumerate(tpots)}}


def _server(name, work, env=None, **args):
    """A configuration's server as perf/online.py builds it (not started): its command, its log."""
    run = argparse.Namespace(port=1, model="qwen3-8b", dtype="bfloat16", load_format="dummy", max_model_len=2048,
                             max_num_seqs=64, max_num_batched_tokens=4096, cpu=False, trace=0,
                             gpu_memory_utilization=0.4, **args)
    return online.Server(name, run, "/m", work, env or {}, [], False)


def test_paired_ratio_cancels_the_request_mix():
    rng = np.random.default_rng(0)
    vanilla = [_window("vanilla", k, list(rng.uniform(4.0, 9.0, 40))) for k in range(3)]
    dmi = [_window("dmi-hidden", k, [t * 1.02 for t in v["tpot_by_request"].values()]) for k, v in enumerate(vanilla)]
    dmi[1]["tpot_by_request"].pop("7")                          # a request that did not finish: no pair
    rows = json.loads(json.dumps(vanilla + dmi))                 # as --baseline reads them back
    base = {16.0: [r for r in rows if r["config"] == "vanilla"]}
    ratio, n = online.paired_ratio([r for r in rows if r["config"] == "dmi-hidden"], base[16.0])
    assert ratio == pytest.approx(1.02) and n == 119
    text = online.table(rows, base)
    line = next(x for x in text.splitlines() if x.startswith("| dmi-hidden"))
    assert line.rstrip(" |").endswith("1.020 (119)")


def test_a_reference_other_than_vanilla_pairs_each_request_with_its_own_on_it():
    """--reference dmi-final: dmi-offered's null cost, request by request, with vanilla's rows left
    out of the comparison and the reference's own rows unpaired."""
    rng = np.random.default_rng(1)
    final = [_window("dmi-final", k, list(rng.uniform(7.0, 9.0, 30))) for k in range(2)]
    offered = [_window("dmi-offered", k, [t * 1.005 for t in w["tpot_by_request"].values()]) for k, w in enumerate(final)]
    vanilla = [_window("vanilla", k, [t * 0.9 for t in w["tpot_by_request"].values()]) for k, w in enumerate(final)]
    rows, base = final + offered + vanilla, {16.0: final}
    cells = {x.split("|")[1].strip(): [c.strip() for c in x.strip().strip("|").split("|")]
             for x in online.table(rows, base, "dmi-final").splitlines()[2:]}
    assert "TPOT p50 / dmi-final" in online.table(rows, base, "dmi-final").splitlines()[0]
    assert cells["dmi-offered"][-1] == "1.005 (60)" and cells["vanilla"][-1] == "0.900 (60)"
    assert cells["dmi-final"][-1] == "" and cells["dmi-final"][-2] == "1.000"
    lines = online.window_table(rows, base, "dmi-final").splitlines()
    assert "dmi-final TPOT p50 (ms)" in lines[0] and not any(x.startswith("| dmi-final") for x in lines[2:])
    assert [x.split("|")[10].strip() for x in lines[2:] if x.startswith("| dmi-offered")] == ["1.005", "1.005"]


def test_windows_without_per_request_figures_give_no_paired_ratio():
    old = {k: v for k, v in _window("vanilla", 0, [5.0, 6.0]).items() if k != "tpot_by_request"}
    assert online.paired_ratio([_window("dmi-hidden", 0, [5.1, 6.1])], [old]) is None


def test_window_table_pairs_each_window_with_vanillas_of_the_same_index():
    """Near saturation a window either keeps up or queues: each window against vanilla's own."""
    vanilla = [_window("vanilla", k, [5.0, 6.0, 7.0]) for k in range(2)]
    dmi = [_window("dmi-hidden", 0, [5.5, 6.6, 7.7]), _window("dmi-hidden", 1, [5.1, 6.12, 7.14])]
    vanilla[1]["ttft_p50"] = 1387.0
    base = {16.0: vanilla}
    lines = [x for x in online.window_table(vanilla + dmi, base).splitlines() if x.startswith("| dmi-hidden")]
    assert len(lines) == 2
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines]
    assert cells[0][2] == "0" and cells[0][8] == "1.100" and cells[0][9] == "1.100"
    assert cells[1][2] == "1" and cells[1][5] == "1387" and cells[1][8] == "1.020" and cells[1][9] == "1.020"
    assert cells[0][10:] == ["", "", "", ""]                    # no GPU samples, no probe (a CPU run, an older baseline)
    dmi[0]["gpu"] = online.gpu_summary("1980, 612.5, 61\n1755, 700.1, 66\n[N/A], [N/A], [N/A]\n1980, 650.0, 63\n")
    vanilla[0]["gpu"] = online.gpu_summary("1980, 600.0, 60\n")
    row = next(x for x in online.window_table(vanilla + dmi, base).splitlines() if x.startswith("| dmi-hidden | 16 | 0"))
    assert [c.strip() for c in row.strip("|").split("|")][10:12] == ["1980 (1755)", "1980 (1980)"]
    dmi[0]["stepclock"] = {"all": {"probe": 0.9351}}           # (--probe: the window's mean host probe)
    vanilla[0]["stepclock"] = {"all": {"probe": 0.685}}
    row = next(x for x in online.window_table(vanilla + dmi, base).splitlines() if x.startswith("| dmi-hidden | 16 | 0"))
    assert [c.strip() for c in row.strip("|").split("|")][12:] == ["0.935", "0.685"]
    assert dmi[0]["gpu"]["samples"] == 3 and dmi[0]["gpu"]["temp_c_max"] == 66


def test_gpu_sampler_without_nvidia_smi_records_nothing(monkeypatch, tmp_path):
    """Where nvidia-smi is missing (CPU machines) a window runs unsampled, not failed."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with online.GpuSampler() as gpu:
        pass
    assert gpu.summary is None and online.gpu_summary("") is None
    tool = tmp_path / "nvidia-smi"          # a stand-in that samples like nvidia-smi -lms: a line at a time
    tool.write_text("#!/bin/sh\nwhile true; do echo '1410, 650.5, 70'; sleep 0.05; done\n")
    tool.chmod(0o755)
    with online.GpuSampler() as gpu:
        import time
        time.sleep(0.4)
    assert gpu.summary["sm_mhz_p50"] == 1410 and gpu.summary["samples"] >= 2 and gpu.proc.poll() is not None


def test_offline_table_shows_each_pair_beside_the_ratio_of_medians():
    """perf/offline.py: the ratio of medians can be a lucky draw of vanilla's spread, so the table
    shows each run's own ratio to the vanilla run before it (lowest, median, highest), and the
garbage collector's share of the runs beside their vanilla runs'."""
    import offline
    base = {"model": "qwen3-8b", "batch": 32, "mode": "compiled", "tok_s": 2000.0, "seconds": 3.9}
    rows = [dict(base, config="vanilla", ratio=1.0),
            dict(base, config="dmi hidden+logits -> host", ratio=1.002, pair_ratios=[0.947, 0.948, 1.037],
                 bytes=5.97e9, d2h_gbs=1.5, drops=0, ring=1.25 * 2**30, gpu_bytes=1282 * 2**20,
                 gc_s=[(0.12, 1), (0.02, 0)], vanilla_gc_s=[(0.0, 0), (0.25, 1)])]
    lines = offline.table(rows).splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[5:7] == ["1.002", "0.947 / 0.948 / 1.037"] and cells[13] == "0"
    assert cells[-2:] == ["0.070 (1)", "0.125 (1)"]     # GC inside the runs: median s, full collections
    assert [c.strip() for c in lines[2].strip("|").split("|")][6] == ""       # vanilla: no pairs


def test_every_window_sends_prompts_of_its_own():
    """A prompt sent twice to a server hits vLLM's prefix cache (on by default) and skips its
    prefill: no two windows of a run may share a work item, rounds included."""
    loads = [online.load_of("16"), online.load_of("c8")]
    offsets = online.window_offsets(loads, repeats=3, duration=10.0)
    spans = sorted((offsets[rep, i], offsets[rep, i] + online.prompts_needed(load, 10.0, 1000 + i))
                   for rep in range(3) for i, load in enumerate(loads))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[0][0] == 0 and spans[-1][1] == offsets["total"]
    assert online.prompts_needed(loads[1], 10.0, 1001) == 8 * 40            # 8 clients, 40 requests each at most
    assert loads == [16.0, "c8"] and online.label(loads[0]) == "16" and online.clients(loads[1]) == 8
    for bad in ("c0", "fast", "-4"):
        with pytest.raises(SystemExit, match="neither a rate"):
            online.load_of(bad)


def test_interleaved_rounds_run_every_server_once_a_window_first_server_alternating():
    """``--interleave``: each (round, load) window is run by every server, once, and who goes first
    alternates by round (no server always measured right after the other's load)."""
    windows = [(rep, i) for rep in range(3) for i in range(2)]
    rounds = online.interleaved(["vanilla", "dmi-hidden"], windows)
    assert [(rep, i) for rep, i, _ in rounds] == windows
    assert all(sorted(turn) == ["dmi-hidden", "vanilla"] for _, _, turn in rounds)
    assert [turn[0] for _, _, turn in rounds] == ["vanilla", "vanilla", "dmi-hidden", "dmi-hidden", "vanilla", "vanilla"]


def test_a_baseline_whose_windows_sent_other_prompts_is_refused():
    loads = [16.0, "c64"]
    offsets = online.window_offsets(loads, repeats=2, duration=10.0)
    online.check_baseline({"rate": "c64", "repeat": 1, "offset": offsets[1, 1]}, loads, offsets, "b.json")
    for row in ({"config": "vanilla", "rate": 16.0, "repeat": 1, "offset": 0},     # an older run: every round the same prompts
                {"config": "vanilla", "rate": 16.0, "repeat": 0},                 # before windows recorded their prompts
                {"config": "vanilla", "rate": 32.0, "repeat": 0, "offset": 0}):   # a load this run does not have
        with pytest.raises(SystemExit, match="b.json: vanilla's window"):
            online.check_baseline(row, loads, offsets, "b.json")


def test_closed_loop_keeps_n_requests_in_flight_each_client_its_own_items():
    """``cN``: N clients against a real HTTP server streaming completions (a stand-in for vLLM's
    OpenAI server, SSE chunks as it sends them): never more than N requests at once, each client
    sends the items of its own stride once, and none starts after the window's duration."""
    import asyncio
    import time
    seen, live, peak = [], [0], [0]

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length))
        seen.append((time.perf_counter(), body["prompt"][0]))
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            writer.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await writer.drain()
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        writer.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        live[0] -= 1
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        work = [([i], 3) for i in range(100)]
        t0 = time.perf_counter()
        async with server:
            got = await online.run_closed("127.0.0.1", port, "m", 4, 0.6, 2.0, work, offset=10, limit=60)
        return got, t0

    (results, window, cutoff), t0 = asyncio.run(main())
    assert peak[0] == 4 and len(results) == len(seen) > 8
    assert all(r.done and r.error is None and r.tokens == 3 for r in results)
    prompts = [p for _, p in seen]
    assert len(set(prompts)) == len(prompts) and all(10 <= p < 70 for p in prompts)
    for k in range(4):                                         # client k: items k, k+4, k+8, ... in order
        mine = sorted(r.index for r in results if r.index % 4 == k)
        assert mine == list(range(k, k + 4 * len(mine), 4))
    assert max(t for t, _ in seen) < t0 + 0.6 + 0.05 and window < 0.6 + 2.0


def test_a_shared_server_turns_the_prefix_cache_off_on_every_server(tmp_path):
    """``--interleave`` runs dmi-hidden-optout on dmi-hidden's server; that server then sees each
    window's prompts twice, so every server starts with vLLM's prefix cache off (the first such run
    measured the second configuration's windows with every prompt cached)."""
    args = argparse.Namespace(sink="host", ring_gib=1.0, policy_mode="full", host_gib=None, max_num_seqs=64,
                              busy_us=600.0, base_src=None, model="qwen3-8b")
    cfgs = online.configurations(args, tmp_path, tmp_path / "stores")
    names = ["vanilla", "dmi-hidden", "dmi-hidden-optout"]
    assert online.servers_of(cfgs, names) == {"vanilla": "vanilla", "dmi-hidden": "dmi-hidden",
                                              "dmi-hidden-optout": "dmi-hidden"}
    assert online.servers_of(cfgs, ["vanilla", "dmi-hidden-optout"])["dmi-hidden-optout"] == "dmi-hidden-optout"
    # the interventions offered and the requests asking for them: one server
    assert online.servers_of(cfgs, ["dmi-offered", "dmi-offered-steered"])["dmi-offered-steered"] == "dmi-offered"

    def cmd(no_prefix_cache):
        return _server("vanilla", tmp_path, graph_sizes=[1, 2, 512], no_prefix_cache=no_prefix_cache).cmd
    for off in (True, False):           # the graph sizes stay whatever the cache does
        c = cmd(off)
        assert ("--no-enable-prefix-caching" in c) == off
        assert json.loads(c[c.index("--compilation-config") + 1]) == {"cudagraph_capture_sizes": [1, 2, 512]}


def test_the_config_table_shows_vllms_compile_time_from_the_server_log(tmp_path):
    """vLLM's compile time, read from its server's log (the line vLLM 0.25.1 prints), goes beside the
    start-up: dmi's site ops once made it 94 s against vanilla's 12 (every layer compiled anew)."""
    server = _server("dmi-hidden", tmp_path, graph_sizes=[1, 2], no_prefix_cache=False)
    assert server.compile_s() is None                    # no log yet
    server.log_path.write_text("(EngineCore pid=3441) INFO 12-03 08:28:59 [monitor.py:53] torch.compile took "
                               "114.30 s in total\n")
    assert server.compile_s() == pytest.approx(114.3)
    text = online.config_table([{"config": "dmi-hidden", "startup_s": 188.0, "compile_s": server.compile_s(),
                                 "stop_s": 10.0, "store": {"status": "closed", "steps": 5}},
                                {"config": "vanilla", "note": "skipped (time limit)"}])
    rows = [line.split(" | ") for line in text.splitlines()]
    assert rows[0][2] == "vLLM's compile (s)" and rows[2][1:3] == ["188", "114.3"]
    assert rows[3][1:3] == ["skipped (time limit)", ""] and len({len(r) for r in rows}) == 1


def test_a_base_configuration_imports_the_earlier_checkouts_dmi_first(tmp_path):
    args = argparse.Namespace(sink="host", ring_gib=1.0, host_gib=None, policy_mode="full", busy_us=600.0, model="qwen3-8b",
                              base_src=str(tmp_path / "base"))
    env, _, _, store = online.configurations(args, tmp_path, tmp_path / "stores")["dmi-hidden-base"]
    assert store.name == "dmi-hidden-base.zarr"              # its own spec file: its own compile cache entry
    server = _server("dmi-hidden-base", tmp_path, env=env, graph_sizes=[1, 2], no_prefix_cache=False)
    path = server.env["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [str(tmp_path / "base"), str(online.REPO)] and "DMI_PERF_SRC" not in server.env
    plain = _server("dmi-hidden", tmp_path, graph_sizes=[1, 2], no_prefix_cache=False)
    assert plain.env["PYTHONPATH"].split(os.pathsep)[0] == str(online.REPO)


def test_interleaved_servers_memory_share_checked_before_start_up():
    """Three Qwen3-8B servers at the default 0.8 fit a 139 GiB H200 but not an 80 GiB H100 (each
    would get 21 GiB for 15 GiB of weights and a 4 GiB ring: vLLM failed only after compiling)."""
    GiB = online.GiB
    args = argparse.Namespace(model="qwen3-8b", dtype="bfloat16", gpu_memory_utilization=0.8 / 3)
    online.check_memory_share(args, 4 * GiB, 3, 139 * GiB)
    with pytest.raises(SystemExit, match=r"3 servers on a 80 GiB GPU get 21.3 GiB each.*15.3 weights \+ 4 ring"):
        online.check_memory_share(args, 4 * GiB, 3, 80 * GiB)
    args.gpu_memory_utilization = 0.93 / 3                           # what ran on the H100, with a 2 GiB ring
    online.check_memory_share(args, 2 * GiB, 3, 80 * GiB)
    online.check_memory_share(args, 4 * GiB, 3, None)                # no GPU: vLLM's own check stands


def test_ring_bytes_read_from_each_configurations_hook_spec(tmp_path):
    """The memory check's ring is what each server's hook spec asks for (dmi-internals: twice)."""
    args = argparse.Namespace(sink="host", ring_gib=1.5, policy_mode="full", host_gib=None, max_num_seqs=64,
                              busy_us=600.0, base_src=None, model="qwen3-8b")
    cfgs = online.configurations(args, tmp_path, tmp_path / "stores")
    rings = {n: online.ring_bytes(cfgs[n]) for n in ("vanilla", "hooks", "dmi-hidden", "dmi-internals")}
    assert rings == {"vanilla": 0, "hooks": 0, "dmi-hidden": 3 << 29, "dmi-internals": 3 << 30}


def test_tokens_per_chunk_shows_an_api_server_streaming_behind_the_engine():
    """Chunks carrying several tokens each: the first one came late, and TPOT over the chunks
    looks shorter than the engine's."""
    def result(i, tokens, chunks, first):
        r = online.Result(sent=0.0, index=i)
        r.first, r.last, r.tokens, r.chunks, r.done = first, first + 1.0, tokens, chunks, True
        return r
    prompt = online.summarize([result(0, 100, 100, 0.05), result(1, 100, 100, 0.05)], window=10.0, cutoff=20.0)
    behind = online.summarize([result(0, 100, 25, 0.35), result(1, 100, 75, 0.35)], window=10.0, cutoff=20.0)
    assert prompt["tokens_per_chunk"] == 1.0 and behind["tokens_per_chunk"] == 2.0
    assert behind["ttft_p50"] == pytest.approx(350.0) and prompt["tpot_p50"] == behind["tpot_p50"]
    running = online.Result(sent=0.0, index=2)             # not finished: not counted
    running.chunks, running.tokens = 3, 3
    assert online.summarize([result(0, 100, 50, 0.05), running], window=10.0, cutoff=20.0)["tokens_per_chunk"] == 2.0


def test_a_reference_neither_run_nor_in_the_baseline_is_refused_before_any_server(tmp_path, capsys):
    """Else every ratio column would stay empty: the error names the flag, the baseline and the fix."""
    (tmp_path / "b.json").write_text(json.dumps({"rates": [{"config": "vanilla", "rate": 16.0, "repeat": 0,
                                                            "offset": 0}]}))
    for extra, where in (([], "not among --configs ['dmi-offered']. Fix"),
                         (["--baseline", str(tmp_path / "b.json")],
                          f"not among --configs ['dmi-offered'] nor in --baseline {tmp_path / 'b.json'}. Fix")):
        with pytest.raises(SystemExit):
            online.main(["--cpu", "--configs", "dmi-offered", "--reference", "dmi-final", "--rates", "16",
                         "--work", str(tmp_path / "w"), *extra])
        err = capsys.readouterr().err
        assert f"--reference dmi-final: {where}" in err and "add it to --configs" in err
    assert not list((tmp_path / "w").glob("server-*.log"))     # no server started
