"""The CUDA path's Triton kernels on the CPU (Triton's interpreter), bit for bit against dmi.gather.

Triton reads TRITON_INTERPRET when a kernel is defined, so the sections of this file run in a
subprocess that sets it before anything imports Triton: two of them (one start-up of torch, Triton
and transformers each), one for the sections that run eagerly (the tests of this file) and one for
those that compile (dynamo, inductor: tests/test_kernels_interpret_compiled.py, a file of its own
that pytest-xdist's other worker runs beside this one); each section with the environment its
process started with, and each test reads its own section's outcome. The sections exercise the capture
and end-marker kernels directly (layouts, strides, compaction, flags, meta-ring wrap) and through
the whole run (the hook spec's ``engine.ring: interpret``: the CUDA ring's control words and kernels over host
memory), in both launch modes: eager (host-known rows: torch copies straight into the ring and a
host-written record) and graph (the kernels, everything read from the device control tensor, as a
replayed CUDA graph does).
"""
from __future__ import annotations

import json
import os
import subprocess
import traceback
import types
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EAGER = ("kernel", "generate", "wrap_null", "stream", "control")
COMPILED = ("traced", "rewrite", "side", "side_generate")
# the sections' torch threads: the test process's (tests/conftest.py: a pytest-xdist worker's share)
THREADS = int(os.environ.get("OMP_NUM_THREADS", "2"))


def _sections(tmp_path_factory, names: tuple) -> tuple:
    """(section -> "" when it passed, else its traceback; the subprocess's result): each of
    ``names`` run once, in order, by one subprocess."""
    results = tmp_path_factory.mktemp("interpret") / "sections.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, str(results), *names], env=env, capture_output=True, text=True,
                       timeout=2700)
    return (json.loads(results.read_text()) if results.exists() else {}), r


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return _sections(tmp_path_factory, EAGER)


def _engine(spec: dict, **options) -> dict:
    """``spec`` with these options in its engine section (``ring`` unless given: interpret)."""
    return {**spec, "engine": {"ring": "interpret", **spec.get("engine", {}), **options}}


def _check(outcomes, section: str) -> None:
    done, r = outcomes
    assert section in done, f"section {section} never finished (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    assert not done[section], f"section {section} failed:\n{done[section]}\n{r.stderr[-4000:]}"


def test_kernel_rows_equal_reference(outcomes):
    _check(outcomes, "kernel")


def test_generate_through_kernels_equals_cpu_path(outcomes):
    _check(outcomes, "generate")


def test_tiny_ring_wraps_and_null_mode(outcomes):
    _check(outcomes, "wrap_null")


def test_steps_larger_than_staging_or_the_ring_never_hang_and_store_what_the_cpu_path_stores(outcomes):
    _check(outcomes, "stream")


def test_a_reused_layout_resends_its_words_after_another_step_changed_them(outcomes):
    _check(outcomes, "control")


# --- sections (run in the subprocess) ---------------------------------------------------------------
def _site(name, layout, dims, shape, outputs=None, heads=None, reduce=None, index=0):
    from dmi.plan import Output, SitePlan, TokenFilter
    outputs = outputs or (Output(name, tuple(dims), tuple(shape), "float"),)
    return SitePlan(index=index, name=name, canonical=name, layer=None, group=name, dims=tuple(dims),
                    shape=tuple(shape), anchor={"layout": list(layout)}, tokens=TokenFilter(), outputs=tuple(outputs),
                    reduce=reduce, heads=heads)


def section_kernel() -> None:
    import numpy as np
    import torch

    from dmi.gather import gather
    from dmi.kernels import capture as K
    from dmi.kernels.kernel_ring import KernelRing
    from dmi.kernels.site_launch import SiteLaunch
    from dmi.plan import Output
    from dmi.ring.records import META_DTYPE
    from dmi.ring.protocol import Ring

    rng = np.random.default_rng(0)
    META = 8                                       # a small meta ring: sequence numbers wrap it
    seq_no = 5
    ranged = []                                    # sites a case copied as one row range (copied_as_range)

    def run_case(x, site, rows, batch, step_seq, dtype, *, enabled=1, armed=1, launcher=None, addend=None, keys=0):
        """``addend``: the site's value is ``x + addend`` (dmi::capture_sum): graph launches sum in
        the kernel, eager ones are handed the sum, and a row range is added into the ring (as
        KernelRing.capture does). ``keys``: the step's key columns (key sites)."""
        nonlocal seq_no
        seq_no += 3
        ctrl = torch.zeros(4096, dtype=torch.int64)
        hdr = K.G_WORDS + K.S_WORDS * site.index
        start, pad_start = 600, 500
        pad = torch.from_numpy(rng.integers(0, 3, batch).astype(np.int64))
        ctrl[:K.G_WORDS] = torch.tensor([armed, 11, batch, step_seq, 99, pad_start, 0, 0, 0, keys])
        ctrl[pad_start:pad_start + batch] = pad
        ctrl[start:start + len(rows)] = torch.from_numpy(rows)
        ctrl[hdr:hdr + K.S_WORDS] = torch.tensor([1024, seq_no, len(rows), start, enabled, 0])
        ring = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)   # poisoned: every byte read must be written
        meta = np.zeros(META, META_DTYPE)
        meta_t = torch.from_numpy(meta.view(np.int64))
        summed = x + addend if addend is not None else x
        outs, src_seq = gather(summed, site, torch.from_numpy(rows), step_seq, batch, pad, dtype, keys)
        want = torch.cat([o.contiguous().reshape(-1).view(torch.uint8) for o in outs])

        class R:                                   # the attributes SiteLaunch reads from a ring
            pass
        r = R()
        r.payload, r.ctrl, r.meta_dev = ring, ctrl, meta_t
        r.meta_records, r.max_rows, r.ctrl_words = META, 512, ctrl.numel()
        r.arange, r.geometry, r.null = torch.arange(512), (batch, step_seq), False
        r.pdl = False                              # (programmatic dependent launch: CUDA devices only)
        r.payload_t, r.meta_view = ring, (lambda: meta)
        r.publish_record = types.MethodType(Ring.publish_record, r)      # eager steps: the host writes records
        r._meta_words = None
        r._payload_views, r.payload_as = {}, types.MethodType(KernelRing.payload_as, r)   # eager gathers
        r.copy_rows = types.MethodType(KernelRing.copy_rows, r)          # row ranges: one strided copy
        launcher = launcher or SiteLaunch(site, dtype, torch.device("cpu"))

        class Step:                                # the host's view of the step (eager launches)
            pass
        st = Step()
        st.tokens = Step()
        st.tokens.batch, st.tokens.seq = batch, step_seq
        st.slots = {site.index: Step()}
        st.slots[site.index].rows = rows
        st.slots[site.index].offset, st.slots[site.index].seq, st.step = 1024, seq_no, 11
        st.dev_rows_start, st.dev_pad_start, st.pad, st.keys = {site.index: start}, pad_start, pad.numpy(), keys
        st.dev_rows = {}                           # (StepControl.dev_rows: the rows views of eager captures)
        st.ranges = {}                             # (StepControl.ranges: copied_as_range's analysis of rows arrays)
        # device flags off only matter to graph launches (eager ones are skipped on the host); an eager
        # capture whose rows are one range of x's rows is one copy, else the eager path (below)
        for mode in ("range", "eager", "graph") if enabled and armed else ("graph",):
            if mode == "graph" and enabled == K.ENABLED_ARANGE:    # rows 0..n-1: the kernel must not read them
                ctrl[start:start + len(rows)] = -7
            ring.fill_(0xAB)
            meta[:] = 0
            if mode == "range":      # as KernelRing.capture: a sum added into the ring where its tensors share a layout
                if launcher.copied_as_range(r, x, st, addend):
                    ranged.append(site.name + ("+" if addend is not None else ""))
                elif addend is not None and launcher.copied_as_range(r, summed, st):
                    ranged.append(site.name)
                else:
                    continue
            else:
                launcher.launch(r, x, st if mode == "eager" else None, addend)
            rec = meta[seq_no % META]
            if not (enabled and armed):
                assert int(rec["seq"]) == 0 and bool((ring == 0xAB).all()), "a disabled capture wrote"
                continue
            assert int(rec["seq"]) == seq_no and int(rec["step"]) == 11 and int(rec["site"]) == site.index
            assert int(rec["offset"]) == 1024 and int(rec["nbytes"]) == want.numel(), (rec, want.numel())
            assert int(rec["rows"]) == outs[0].shape[0] and int(rec["src_seq"]) == src_seq
            got = ring[1024:1024 + want.numel()]
            assert torch.equal(got, want), (site.name, mode)
            assert bool((ring[1024 + want.numel():1024 + want.numel() + 64] == 0xAB).all()), "wrote past the record"

    def rows_of(batch, seq, p=0.6):
        keep = rng.random(batch * seq) < p
        keep[-1] = True
        return np.nonzero(keep)[0].astype(np.int64)

    B, S = 3, 7
    # plain sites (DIRECT): strides straight from the engine tensor
    x = torch.randn(B, S, 96, dtype=torch.bfloat16)
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), rows_of(B, S), B, S, torch.bfloat16)
    q = torch.randn(B, S, 4, 16).transpose(1, 2)               # [batch, head, seq, head_dim], not contiguous
    run_case(q, _site("q", ["batch", "head", "seq", "head_dim"], ["head", "head_dim"], [4, 16], index=3),
             rows_of(B, S), B, S, torch.float32)
    z = torch.randn(B, S, 4, 40)[..., 4:36]                     # strided view
    run_case(z, _site("z", ["batch", "seq", "head", "head_dim"], ["head", "head_dim"], [4, 32], index=1),
             rows_of(B, S), B, S, torch.float32)
    tok = torch.randn(B * S, 10)                                # token-major (MoE router logits)
    run_case(tok, _site("router", ["token", "expert"], ["expert"], [10], index=2), rows_of(B, S), B, S, torch.float32)
    logits = torch.randn(B, 1, 50)                              # logits_to_keep=1: compaction
    run_case(logits, _site("logits", ["batch", "seq", "vocab"], ["vocab"], [50]), rows_of(B, S, 0.8), B, S,
             torch.float32)
    # a site held as two tensors (vLLM's residual stream, dmi::capture_sum): the kernel copies the
    # rows of their sum, rounded as torch's add rounds; bfloat16 and float32, listed rows and rows
    # 0 .. n-1, and two tensors of different strides (added first, then copied)
    resid = _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96])
    run_case(x, resid, rows_of(B, S), B, S, torch.bfloat16, addend=torch.randn(B, S, 96, dtype=torch.bfloat16) * 50)
    run_case(tok, _site("router", ["token", "expert"], ["expert"], [10], index=2), np.arange(B * S - 2, dtype=np.int64),
             B, S, torch.float32, enabled=K.ENABLED_ARANGE, addend=torch.randn(B * S, 10))
    run_case(x, resid, rows_of(B, S), B, S, torch.bfloat16,
             addend=torch.randn(B, 96, S, dtype=torch.bfloat16).transpose(1, 2))
    # the same held rows launched eagerly step after step (vLLM's logits in steady decode): their
    # index in x is uploaded once and reused; other rows or another src_seq upload again
    import dmi.kernels.site_launch as cr
    uploads, upload = [], cr.upload
    cr.upload = lambda a, device: (uploads.append(len(a)), upload(a, device))[1]
    site = _site("logits", ["batch", "seq", "vocab"], ["vocab"], [50])
    same = SiteLaunch(site, torch.float32, torch.device("cpu"))
    rows = rows_of(B, S, 0.8)
    for _ in range(3):
        run_case(torch.randn(B, 2, 50), site, rows.copy(), B, S, torch.float32, launcher=same)
    assert len(uploads) == 1, uploads
    run_case(torch.randn(B, 3, 50), site, rows, B, S, torch.float32, launcher=same)
    run_case(torch.randn(B, 3, 50), site, rows, B, S, torch.float32, launcher=same)
    run_case(torch.randn(B, 3, 50), site, rows[1:], B, S, torch.float32, launcher=same)
    assert len(uploads) == 3, uploads
    cr.upload = upload
    # rows 0 .. n-1 flagged (enabled 2): the kernel takes each row as its index, reads no rows
    # (run_case poisons them before the graph launch); a prefix of the step and all of it
    for k in (5, B * S):
        run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), np.arange(k, dtype=np.int64), B, S,
                 torch.bfloat16, enabled=K.ENABLED_ARANGE)
        run_case(tok, _site("router", ["token", "expert"], ["expert"], [10], index=2), np.arange(k, dtype=np.int64),
                 B, S, torch.float32, enabled=K.ENABLED_ARANGE)
    # row ranges copied at once: a contiguous run of a [batch, seq, ...] tensor, of a token-major one, of
    # rows spaced wider than they are long (a slice of a fused projection), and logits rows held at the
    # end of each sequence; a transposed tensor (features not contiguous) and scattered rows are not
    ranged.clear()
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), np.arange(4, 13, dtype=np.int64), B, S,
             torch.bfloat16)
    run_case(tok, _site("router", ["token", "expert"], ["expert"], [10], index=2), np.arange(2, 9, dtype=np.int64),
             B, S, torch.float32)
    fused = torch.randn(B * S, 3 * 24)[:, 24:48]                  # v of a fused qkv: row pitch 72, length 24
    run_case(fused, _site("v", ["token", "hidden"], ["hidden"], [24], index=4), np.arange(3, 17, dtype=np.int64),
             B, S, torch.float32)
    run_case(torch.randn(B, 1, 50), _site("logits", ["batch", "seq", "vocab"], ["vocab"], [50]),
             np.arange(B, dtype=np.int64) * S + S - 1, B, S, torch.float32)
    # the rows of a sum (vLLM's residual stream in a step without CUDA graphs): added into the ring by
    # one kernel, rounded as torch's add; an addend of other strides is added first, then copied
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), np.arange(2, 20, dtype=np.int64), B, S,
             torch.bfloat16, addend=torch.randn(B, S, 96, dtype=torch.bfloat16) * 50)
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), np.arange(2, 20, dtype=np.int64), B, S,
             torch.bfloat16, addend=torch.randn(B, 96, S, dtype=torch.bfloat16).transpose(1, 2))
    assert ranged == ["resid", "router", "v", "logits", "resid+", "resid"], ranged
    run_case(torch.randn(B, 96, S).transpose(1, 2), _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]),
             np.arange(4, 13, dtype=np.int64), B, S, torch.float32)
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), np.array([1, 2, 4], np.int64), B, S,
             torch.bfloat16)
    assert len(ranged) == 6, ranged
    # flags: a dropped capture and an unarmed step write nothing
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), rows_of(B, S), B, S, torch.bfloat16,
             enabled=0)
    run_case(x, _site("resid", ["batch", "seq", "hidden"], ["hidden"], [96]), rows_of(B, S), B, S, torch.bfloat16,
             armed=0)
    # IDENTITY: head selection, dtype change, top-k with an odd k (two outputs, 2-byte words), norms, keys
    run_case(q.to(torch.bfloat16), _site("qh", ["batch", "head", "seq", "head_dim"], ["head", "head_dim"], [4, 16],
                                         outputs=(Output("qh", ("head", "head_dim"), (2, 16), "float"),), heads=(3, 1)),
             rows_of(B, S), B, S, torch.bfloat16)
    run_case(x.float(), _site("resid32", ["batch", "seq", "hidden"], ["hidden"], [96]), rows_of(B, S), B, S,
             torch.bfloat16)
    run_case(torch.randn(B, 1, 50, dtype=torch.bfloat16),
             _site("topk", ["batch", "seq", "vocab"], ["vocab"], [50], reduce={"topk": 5},
                   outputs=(Output("topk_values", ("k",), (5,), "float"), Output("topk_indices", ("k",), (5,), "int32"))),
             rows_of(B, S, 0.8), B, S, torch.bfloat16)
    run_case(x, _site("norm", ["batch", "seq", "hidden"], ["hidden"], [96], reduce={"norm": True},
                      outputs=(Output("norm", (), (), "float"),)), rows_of(B, S), B, S, torch.bfloat16)
    pat = torch.softmax(torch.randn(B, 4, S, 9), -1)           # 9 key columns, left padding up to 2
    run_case(pat, _site("pattern", ["batch", "head", "seq", "key"], ["head", "key"], [4, 12]), rows_of(B, S), B, S,
             torch.float32)
    # a sliding-window layer's keys: the last 9 of the step's 14 key columns (key positions 3.. up to 13)
    run_case(pat, _site("pattern", ["batch", "head", "seq", "key"], ["head", "key"], [4, 16]), rows_of(B, S), B, S,
             torch.float32, keys=14)
    # the end-marker kernel publishes once and disarms
    ctrl = torch.zeros(64, dtype=torch.int64)
    ctrl[:K.G_WORDS] = torch.tensor([1, 4, B, S, 21, 0, 0, 0, 0, 0])
    meta = np.zeros(META, META_DTYPE)
    counters = torch.zeros(4, dtype=torch.int32)
    K.launch_end(ctrl, torch.from_numpy(meta.view(np.int64)), counters, meta_records=META, fence_idx=3)
    rec = meta[21 % META]
    assert (int(rec["seq"]), int(rec["step"]), int(rec["site"]), int(rec["flags"])) == (21, 4, -1, 0)
    assert int(ctrl[K.G_ARMED]) == 0
    meta[:] = 0
    K.launch_end(ctrl, torch.from_numpy(meta.view(np.int64)), counters, meta_records=META, fence_idx=3)
    assert int(meta["seq"].max()) == 0, "an unarmed end marker was published"
    # a step that ran traced captures: the end kernel publishes their records (enabled sites only), first
    traced = torch.tensor([[0, 0, 128], [1, 1, 64], [2, 2, 32]])     # site, site word, row bytes
    for flag in (0, 1):
        meta[:] = 0
        ctrl[:K.G_WORDS] = torch.tensor([1, 4, B, S, 23, 0, 4096, 19, flag, 0])
        for site, (off, rseq, rows, on) in enumerate([(0, 0, 3, 2), (512, 1, 5, 1), (1024, 2, 7, 0)]):
            h = K.G_WORDS + K.S_WORDS * site
            ctrl[h:h + K.S_WORDS] = torch.tensor([off, rseq, rows, 0, on, 0])
        K.launch_end(ctrl, torch.from_numpy(meta.view(np.int64)), counters, meta_records=META, fence_idx=3, traced=traced)
        got = {int(r["seq"]): (int(r["step"]), int(r["site"]), int(r["offset"]), int(r["nbytes"]), int(r["rows"]),
                               int(r["src_seq"])) for r in meta if r["seq"]}
        want = {23: (4, -1, 0, 0, 0, 0)}
        if flag:       # site 2 is not enabled: no record
            want |= {19: (4, 0, 4096, 3 * 128, 3, S), 20: (4, 1, 4608, 5 * 64, 5, S)}
        assert got == want, (flag, got)
    print("kernel cases ok")


def _compare_stores(a_path, b_path) -> int:
    from storecheck import assert_stores_equal
    return assert_stores_equal(a_path, b_path)


def section_generate() -> None:
    import tempfile

    import torch

    import dmi
    from conftest import PROMPTS, model_pair, windowed_pair
    from dmi.models import tiny_tokenizer
    torch.set_num_threads(THREADS)
    enc = tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    tmp = Path(tempfile.mkdtemp())
    specs = {
        "qwen3": {"capture": [{"sites": ["resid_pre", "resid_post", "final_norm", "attn.q", "attn.z", "mlp.in"]},
                              {"sites": ["attn.pattern"], "layers": [0, 1], "max_keys": 64},
                              {"sites": ["attn.k"], "heads": [1], "layers": [2]},
                              {"sites": ["logits"], "tokens": "all"}]},
        "qwen3_moe": {"capture": [{"sites": ["moe.router_logits", "moe.topk_ids", "resid_post"], "layers": [0]},
                                  {"sites": ["logits"], "tokens": "last", "reduce": {"topk": 5}}]},
        # sliding-window layers (1, 2) beside a full one: decode steps' keys placed past the window
        "qwen3-window": {"capture": [{"sites": ["attn.pattern"], "max_keys": 64}, {"sites": ["resid_post"]}]},
    }
    for family, spec in specs.items():
        outs = {}
        for kind in ("cpu", "eager", "eager-ops", "graph"):
            if family.endswith("-window"):
                model, _ = windowed_pair(family.split("-")[0], 4, attn="sdpa")
            else:
                model, _ = model_pair(family, attn="sdpa")
            with torch.no_grad(), dmi.load(model, hook_spec=_engine(spec, ring="cpu" if kind == "cpu" else "interpret"),
                                           store=tmp / f"{family}-{kind}.zarr") as run:
                if kind == "graph":
                    run.ring.graph_mode = True     # launches read everything from the device control tensor
                if kind == "eager-ops":
                    run.ring.range_copy = False    # every eager capture through the torch ops
                outs[kind] = run.model.generate(**enc, max_new_tokens=3, do_sample=False)
                # another batch, then the first again: decode steps that reuse their layout send the
                # device only the global words, so every change of layout must send it all again
                run.model.generate(**{k: v[:2] for k, v in enc.items()}, max_new_tokens=4, do_sample=False)
                run.model.generate(**enc, max_new_tokens=4, do_sample=False)
                how = {k: n for k, (n, _) in run.ring.eager_time.items()} if kind != "cpu" else {}
            if kind == "eager":    # row ranges (every decode row of a plain site) by one copy, the rest by torch ops
                assert how["copy"] > 0 and how["eager"] > 0, how
            if kind == "eager-ops":
                assert how["copy"] == 0 and how["eager"] > 0, how
        for kind in ("eager", "eager-ops", "graph"):
            assert torch.equal(outs["cpu"], outs[kind])
            n = _compare_stores(tmp / f"{family}-cpu.zarr", tmp / f"{family}-{kind}.zarr")
            print(family, kind, "arrays equal:", n)


def section_traced() -> None:
    """Compiled forwards capture the ring's traceable sites as traced torch ops (dmi.kernels.traced:
    a scatter at destinations read from the control block; the end kernel publishes the records):
    every step's captures equal the CPU path's, sites named by tensor or as constants (generate()'s
    compiled forward), with padded prompts (a listed selection: its
    inverse map), a last-token filter, int32 router ids, and sites left to the op (head selection,
    transformers' logits). ``backend="eager"`` runs the traced graph's ops in place, as inductor's
    code does; ``aot_eager`` would write copies of the ring, and is refused at the first step."""
    import tempfile

    import torch

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.errors import CaptureError
    from dmi.models import tiny_tokenizer
    from dmi.kernels.words import SCRATCH_BYTES
    from dmi.kernels.kernel_ring import InterpretRing
    from dmi.siteop import constant_sites
    torch.set_num_threads(THREADS)
    # the traced scratch rows are allocated only where traced captures may run
    assert InterpretRing(1 << 16, 64).scratch_t.numel() == 1 << 16
    assert InterpretRing(1 << 16, 64, traced="1").scratch_t.numel() == (1 << 16) + SCRATCH_BYTES
    enc = dict(tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True))
    tmp = Path(tempfile.mkdtemp())
    specs = {
        "qwen3": {"capture": [{"sites": ["resid_pre", "resid_post", "final_norm", "attn.q", "mlp.out"]},
                              {"sites": ["attn.k"], "heads": [1], "layers": [2]},
                              {"sites": ["resid_mid"], "tokens": "last"},
                              {"sites": ["logits"], "tokens": "last"}]},
        "qwen3_moe": {"capture": [{"sites": ["moe.router_logits", "moe.topk_ids", "resid_post"], "layers": [0]}]},
    }
    for family, spec in specs.items():
        outs, traced = {}, None
        for kind in ("cpu", "traced", "traced-const"):
            model, _ = model_pair(family, attn="sdpa")
            with torch.no_grad():
                model(**enc)          # transformers' first forward installs its output-capturing hooks
            torch._dynamo.reset()
            # traced: opt-in (engine.traced: all)
            with torch.no_grad(), dmi.load(model, hook_spec=_engine(spec, ring="cpu" if kind == "cpu" else "interpret",
                                                                    traced="all"),
                                           store=tmp / f"{family}-{kind}.zarr") as run:
                forward = run.model.forward
                if kind != "cpu":
                    traced = [run.plan.sites[i].name for i in run.ring.traced]
                    forward = torch.compile(forward, fullgraph=True, backend="eager")
                if kind == "traced-const":       # sites as constants, as generate()'s compiled forward names them
                    forward = constant_sites(forward)
                outs[kind] = [forward(**enc).logits for _ in range(3)]
                stats = run.stats()
            assert stats["not_run"] == 0 and stats["dropped_captures"] == 0, stats
        torch._dynamo.reset()
        assert traced and not any(n.endswith(".attn.k") or n == "logits" for n in traced), traced
        for kind in ("traced", "traced-const"):
            assert all(torch.equal(a, b) for a, b in zip(outs["cpu"], outs[kind]))
            n = _compare_stores(tmp / f"{family}-cpu.zarr", tmp / f"{family}-{kind}.zarr")
            print(family, kind, len(traced), "sites; arrays equal:", n)
    # a backend that functionalizes the scatters without writing the ring in place: a clear error
    model, _ = model_pair("qwen3", attn="sdpa")
    with torch.no_grad():
        model(**enc)
    with torch.no_grad(), dmi.load(model, hook_spec=_engine(specs["qwen3"], traced="all"), store=tmp / "aot.zarr") as run:
        try:
            torch.compile(run.model.forward, fullgraph=True, backend="aot_eager")(**enc)
        except CaptureError as e:
            assert "engine.traced" in str(e) and "aot_eager" in str(e), e
        else:
            raise AssertionError("aot_eager's copies of the ring were not refused")
    torch._dynamo.reset()


def _compile_every_time() -> None:
    """Every inductor compile runs its passes (a whole-graph cache hit, from an earlier compile or an
    earlier run of the suite, would skip them and what they count), while the C++ kernels stay
    cached by their source: a kernel the compiles share (most of them: the same model, with and
    without a pass) is built once, which is most of a compile's time on a small CPU machine."""
    import torch
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def section_rewrite() -> None:
    """Captures rewritten into traced ops by a compile pass (``engine.traced: range``,
    ``dmi.kernels.traced.rewrite_captures``; vLLM runs it on its compile range above the largest
    CUDA graph): a model compiled twice with inductor, once with the pass (every plain site's op
    replaced by its scatter, fused into inductor's kernels) and once without (the op), the steps
    dispatched by token count as vLLM dispatches its ranges (steps up to the threshold run a graph
    that keeps the op, compiled by ``aot_eager`` here), the ring's traced word set in exactly
    the steps above the threshold. Every step's captures equal those of the same compiles without
    the pass, bit for bit (the op's path: the CPU path's in section_traced; a last-token filter:
    its inverse map, sent in traced steps only), and the rewritten graph calls the op only for the
    sites it does not take (a head selection; attn.q, not token-major in transformers' layout)."""
    import tempfile

    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.kernels.traced import rewrite_captures
    from dmi.models import tiny_tokenizer
    from dmi.errors import PolicyError
    from dmi.kernels.kernel_ring import InterpretRing
    torch.set_num_threads(THREADS)
    _compile_every_time()         # the pass runs (and counts) in every compile
    try:                          # the trace modes are named where one is wrong
        InterpretRing(1 << 16, 64, traced="yes")
    except PolicyError as e:
        assert "traced='yes'" in str(e) and "engine.traced" in str(e) and "range" in str(e), e
    else:
        raise AssertionError("an unknown trace mode was taken")

    class Rewrite(CustomGraphPass):
        rewrote = 0

        def __call__(self, graph):
            Rewrite.rewrote += rewrite_captures(graph)
            Rewrite.ops_left = sum(1 for n in graph.nodes if "dmi.capture" in str(n.args[:1]))

        def uuid(self):
            return "dmi-test-rewrite"

    tok = tiny_tokenizer()
    batches = [dict(tok(PROMPTS, return_tensors="pt", padding=True)),        # 3 x 11 rows: above (traced)
               dict(tok(PROMPTS[2:], return_tensors="pt")),                  # 1 row: the op
               dict(tok(PROMPTS[:2], return_tensors="pt", padding=True))]    # 2 x 11: above again
    above = 16
    spec = {"capture": [{"sites": ["resid_post", "final_norm", "attn.q", "mlp.out"]},
                        {"sites": ["attn.k"], "heads": [1], "layers": [2]},
                        {"sites": ["resid_mid"], "tokens": "last"}]}
    tmp = Path(tempfile.mkdtemp())
    outs = {}
    for kind in ("op", "range"):          # the op: the same two compiles without the pass
        model, _ = model_pair("qwen3", attn="sdpa")
        with torch.no_grad():
            model(**batches[0])       # transformers' first forward installs its output-capturing hooks
        torch._dynamo.reset()
        with torch.no_grad(), dmi.load(model, hook_spec=_engine(spec, traced="off" if kind == "op" else "range"),
                                       store=tmp / f"{kind}.zarr") as run:
            forward = run.model.forward
            small = torch.compile(forward, fullgraph=True, dynamic=False, backend="aot_eager")   # (the op either way)
            large = torch.compile(forward, fullgraph=True, dynamic=False,
                                  options={"post_grad_custom_post_pass": Rewrite()} if kind == "range" else {})
            forward = lambda **enc: (large if enc["input_ids"].numel() > above else small)(**enc)  # noqa: E731
            if kind == "range":
                run.ring.traced_above = above
                traced = {run.plan.sites[i].name for i in run.ring.traced}
                # the sites the rewrite takes: token-major ones (attn.q is [batch, heads, seq, dim] here)
                rewritable = [i for i in run.ring.traced if tuple(run.ring.sites[i].layout[:2]) == ("batch", "seq")]
            outs[kind] = [forward(**enc).logits for enc in batches]
            stats = run.stats()
        assert stats["not_run"] == 0 and stats["dropped_captures"] == 0, stats
    torch._dynamo.reset()
    assert traced and not any(n.endswith(".attn.k") for n in traced), traced
    # each rewritten graph (two traced steps of two shapes: two compiles) lost every traceable site's op
    assert len(rewritable) == len(traced) - 3 and Rewrite.rewrote == 2 * len(rewritable), (Rewrite.rewrote, traced)
    assert Rewrite.ops_left == len(run.plan.sites) - len(rewritable), Rewrite.ops_left
    assert all(torch.equal(a, b) for a, b in zip(outs["op"], outs["range"]))
    print("rewrite:", len(rewritable), "sites rewritten; arrays equal:", _compare_stores(tmp / "op.zarr", tmp / "range.zarr"))


def section_side() -> None:
    """Captures chained for a side stream by a compile pass (``dmi.kernels.side.chain_captures``;
    vLLM runs it in its graphed ranges): every capture of a compiled graph is marked ``side=1``,
    takes the previous capture's tensor as an input (kept unwritten until it runs) and the graph
    ends with one ``dmi::join`` holding the last one's. Inductor compiles the chained graph, each
    call runs every marked capture and the join once, after the last capture, and the store is
    the plain compile's bit for bit. (On the CPU nothing forks: a CUDA graph's capture does,
    tests/gpu.)"""
    import tempfile

    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.kernels.side import capture_nodes, chain_captures, sources
    from dmi.models import tiny_tokenizer
    torch.set_num_threads(THREADS)
    _compile_every_time()         # the pass runs in every compile

    class Chain(CustomGraphPass):
        graphs = []

        def __call__(self, graph):
            marked = chain_captures(graph)
            nodes = capture_nodes(graph)
            joins = [n for n in graph.nodes if n.op == "call_function" and n.args[:1] == (torch.ops.dmi.join.default,)]
            assert marked == len(nodes) > 1 and len(joins) == 1, (marked, len(joins))
            order = list(graph.nodes)
            assert all(n.kwargs["side"] == 1 for n in nodes)
            assert all(set(sources(a)) <= set(b.kwargs["after"]) for a, b in zip(nodes, nodes[1:]))
            assert joins[0].kwargs["after"] == sources(nodes[-1]) and order.index(joins[0]) > order.index(nodes[-1])
            Chain.graphs.append(marked)

        def uuid(self):
            return "dmi-test-side"

    enc = dict(tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True))
    spec = _engine({"capture": [{"sites": ["resid_post", "final_norm", "attn.q", "mlp.out"]},
                                {"sites": ["attn.k"], "heads": [1], "layers": [2]}]},
                   traced="off")                     # the op at every site
    tmp = Path(tempfile.mkdtemp())
    outs, calls = {}, []
    for kind in ("plain", "side"):
        model, _ = model_pair("qwen3", attn="sdpa")
        with torch.no_grad():
            model(**enc)              # transformers' first forward installs its output-capturing hooks
        torch._dynamo.reset()
        with torch.no_grad(), dmi.load(model, hook_spec=spec, store=tmp / f"{kind}.zarr") as run:
            ring = run.ring
            join = ring.join_side
            ring.join_side = lambda: (calls.append(("join", dict(ring.side_counts))), join())[1]   # (observed)
            forward = torch.compile(run.model.forward, fullgraph=True, dynamic=False,
                                    options={"post_grad_custom_post_pass": Chain()} if kind == "side" else {})
            outs[kind] = [forward(**enc).logits for _ in range(2)]
            stats, counts = run.stats(), dict(ring.side_counts)
        assert stats["not_run"] == 0 and stats["dropped_captures"] == 0, stats
        if kind == "plain":
            assert counts["marked"] == 0 and not calls, (counts, calls)
    torch._dynamo.reset()
    assert Chain.graphs == [len(run.plan.sites)], Chain.graphs       # one graph, every site's op chained
    # each call: every capture marked, then (as its last op) the join; nothing forked on the CPU
    assert counts == {"marked": 2 * len(run.plan.sites), "forked": 0, "joined": 0}, counts
    # (a marked capture first joins the one before it: the join op's call is the one that follows no new capture)
    marked = [c[1]["marked"] for c in calls]
    assert [m for m, before in zip(marked[1:], marked) if m == before] == [len(run.plan.sites), 2 * len(run.plan.sites)]
    assert all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["side"]))
    print("side:", len(run.plan.sites), "captures chained; arrays equal:", _compare_stores(tmp / "plain.zarr", tmp / "side.zarr"))


def section_side_generate() -> None:
    """transformers' compiled generate (``reduce-overhead``) gets the chain from the HF adapter
    (``engine.side`` left out; :func:`dmi.adapters.hf._chained`) and not with ``engine.side: off``: in each
    compiled decode step every capture is marked and the graph's join runs after the last one; tokens
    and stores equal the inline run's. (On the CPU inductor records no CUDA graph and nothing forks;
    tests/gpu: the graphs.)"""
    import tempfile

    import torch
    from transformers import CompileConfig

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.models import tiny_tokenizer
    torch.set_num_threads(THREADS)
    _compile_every_time()
    enc = dict(tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True))
    spec = {"capture": [{"sites": ["resid_post", "final_norm", "attn.q"]}, {"sites": ["logits"], "tokens": "last"}]}
    tmp = Path(tempfile.mkdtemp())
    new, tokens, seen = 4, {}, {}
    for kind in ("0", "full"):
        model, _ = model_pair("qwen3", attn="sdpa")
        config = CompileConfig(mode="reduce-overhead")
        config._compile_all_devices = True        # (transformers compiles for CUDA devices only unless told)
        torch._dynamo.reset()
        with torch.no_grad(), dmi.load(model, hook_spec=_engine(spec, traced="off", side="off" if kind == "0" else "full"),
                                       store=tmp / f"{kind}.zarr") as run:
            ring, joins = run.ring, []
            join = ring.join_side
            ring.join_side = lambda: (joins.append(1), join())[1]
            tokens[kind] = run.model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                              cache_implementation="static", compile_config=config)
            stats = run.stats()
            seen[kind] = (dict(ring.side_counts), len(joins), ring.side_streams, len(run.plan.sites))
        assert stats["steps"] == new and stats["not_run"] == 0 and stats["dropped_captures"] == 0, stats
    torch._dynamo.reset()
    n = seen["full"][3]
    decode = new - 1                  # (generate's prefill runs uncompiled)
    assert seen["0"][:2] == ({"marked": 0, "forked": 0, "joined": 0}, 0), seen
    # each compiled step: every capture marked (each first joins the one before it), then the join op
    assert seen["full"][:3] == ({"marked": n * decode, "forked": 0, "joined": 0}, (n + 1) * decode, False), seen
    assert torch.equal(tokens["0"], tokens["full"])
    print("side_generate:", n, "captures chained; arrays equal:", _compare_stores(tmp / "0.zarr", tmp / "full.zarr"))


def section_wrap_null() -> None:
    import tempfile

    import torch

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.models import tiny_tokenizer
    torch.set_num_threads(THREADS)
    enc = tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    tmp = Path(tempfile.mkdtemp())
    big = {"capture": [{"sites": ["resid_post", "mlp.out", "final_norm"]}], "policy": {"ring_bytes": "8MiB"}}
    small = {"capture": big["capture"], "policy": {"ring_bytes": "112KiB", "meta_records": 32}}   # ~one prefill
    outs = {}
    for name, spec, kind in (("big", big, "cpu"), ("small", small, "interpret")):
        model, _ = model_pair("qwen3")
        with torch.no_grad(), dmi.load(model, hook_spec=_engine(spec, ring=kind), store=tmp / f"{name}.zarr") as run:
            outs[name] = run.model.generate(**enc, max_new_tokens=30, do_sample=False)
        if name == "small":
            assert run.ring.bytes.head > 2 * run.ring.bytes.capacity, run.ring.bytes.head
            assert run.ring.next_seq > 2 * 32
            assert run.stats()["dropped_captures"] == 0
    assert torch.equal(outs["big"], outs["small"])
    print("wrap: arrays equal:", _compare_stores(tmp / "big.zarr", tmp / "small.zarr"))

    model, ref = model_pair("qwen3")
    with torch.no_grad(), dmi.load(model, hook_spec=_engine(big), store=tmp / "null.zarr") as run:
        run.set_enabled(False)
        got = run.model.generate(**enc, max_new_tokens=4, do_sample=False)
        assert run.stats()["steps"] == 0 and run.stats()["records"] == 0
    assert torch.equal(got, ref.generate(**enc, max_new_tokens=4, do_sample=False))
    tree = dmi.open(tmp / "null.zarr")
    assert tree["final_norm"].dataset.sizes["token"] == 0 and tree.attrs["dmi_status"] == "closed"
    print("null ok")


def section_stream() -> None:
    """The CUDA ring's drain (staging, batches of steps) and its parts of a step larger than the
    ring, under the interpreter: several generate() calls in a row into a store, each bounded in
    time (a stall is an error after stall_timeout_s, the test's bound is above it), equal to the CPU
    path's store. ``paused``: the drain sleeps while the steps pile up, then takes one batch far
    larger than host staging (a wait cycle once: the drain waited for staging that only its own
    batch, not yet handed to the store, held)."""
    import tempfile
    import threading

    import torch

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.models import tiny_tokenizer
    torch.set_num_threads(THREADS)
    enc = tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    tmp = Path(tempfile.mkdtemp())
    capture = [{"sites": ["resid_post", "mlp.out", "final_norm"]}, {"sites": ["logits"], "tokens": "last"}]
    cases = {"reference": ("cpu", {"ring_bytes": "8MiB"}, False),
             "paused": ("interpret", {"ring_bytes": "2MiB", "host_bytes": "16KiB", "stall_timeout_s": 20}, True),
             "streamed": ("interpret", {"ring_bytes": "24KiB", "host_bytes": "16KiB", "meta_records": 32,
                                        "stall_timeout_s": 20}, False)}
    outs = {}
    for name, (kind, policy, paused) in cases.items():
        model, _ = model_pair("qwen3")
        got: dict = {}

        def generates():
            try:
                with torch.no_grad(), dmi.load(model, hook_spec=_engine({"capture": capture, "policy": policy}, ring=kind),
                                               store=tmp / f"{name}.zarr") as run:
                    if paused:
                        run.drain_paced, run.threads.drain_interval = False, 100.0
                    got["out"] = [run.model.generate(**enc, max_new_tokens=12, do_sample=False) for _ in range(3)]
                got["stats"] = run.stats()
            except BaseException as e:     # noqa: BLE001
                got["error"] = e
        t = threading.Thread(target=generates, daemon=True)
        t.start()
        t.join(240)
        assert not t.is_alive(), f"{name}: hung"
        if "error" in got:
            raise got["error"]
        assert got["stats"]["dropped_captures"] == 0, got["stats"]
        if name == "streamed":      # parts sat in host buffers reused from step to step, not one per part
            st = got["stats"]
            assert st["streamed_steps"] >= 3 and 0 < st["stream_buffer_bytes"] < st["bytes_captured"], st
        outs[name] = got["out"]
        if name != "reference":
            assert all(torch.equal(a, b) for a, b in zip(outs["reference"], got["out"]))
            print(name, "arrays equal:", _compare_stores(tmp / "reference.zarr", tmp / f"{name}.zarr"))
    print("stream ok")


def section_control() -> None:
    """A decode step that reuses the last step's layout sends the device only the global words. A
    step in between that took the general path (here: one capture dropped) changed the site words
    on the device, so the next reuse must send them all again."""
    import tempfile

    import numpy as np
    import torch

    import dmi
    from conftest import PROMPTS, model_pair
    from dmi.kernels import capture as K
    from dmi.models import tiny_tokenizer
    enc = tiny_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    model, _ = model_pair("qwen3")
    spec = _engine({"capture": [{"sites": ["resid_post", "final_norm"]}], "policy": {"ring_bytes": "8MiB"}})
    with torch.no_grad(), dmi.load(model, hook_spec=spec, store=Path(tempfile.mkdtemp()) / "c.zarr") as run:
        ring, seen = run.ring, []
        publish = ring.publish_control
        ring.publish_control = lambda ctrl: (seen.append(ctrl), publish(ctrl))[1]
        run.model.generate(**enc, max_new_tokens=4, do_sample=False)
        run.flush()
        last = seen[-1]
        assert last.layout is not None and ring._on_device[0] is last.layout

        def site_words(ctrl_tensor):
            return ctrl_tensor[K.G_WORDS:ring.site_words].numpy().reshape(-1, K.S_WORDS).copy()

        def step(wanted):
            run._owner.claim("a step")
            ctrl = ring.begin_step(run._step, last.tokens, last.pad, wanted)
            run._step += 1
            ring.end_step()                    # host-published end marker
            run._owner.release_step()
            return ctrl

        step(last.layout)
        want = site_words(ring.ctrl)
        # every capture of a decode step takes all of the batch's rows, 0 .. batch-1: flagged so
        assert (want[:, K.S_ENABLED] == K.ENABLED_ARANGE).sum() == len(last.layout.wanted)
        step(last.layout.wanted[1:])           # the general path: the first capture left out
        gap = site_words(ring.ctrl)
        assert gap[last.layout.wanted[0][0], K.S_ENABLED] == 0
        ctrl = step(last.layout)               # the layout again: every word back on the device
        np.testing.assert_array_equal(site_words(ring.ctrl), want)
        g = ring.ctrl[:K.G_WORDS].numpy()
        assert (g[K.G_BASE], g[K.G_FIRST_SEQ], g[K.G_END_SEQ]) == (ctrl.base, ctrl.first_seq, ctrl.end_seq)

        # steady steps send their global words through the head slots, round and round (each slot
        # reused once its last step's end marker is in the meta ring) ...
        from dmi.kernels.kernel_ring import HEAD_SLOTS
        first = ring._head_next
        for i in range(2 * HEAD_SLOTS + 3):
            ctrl = step(last.layout)
            g = ring.ctrl[:K.G_WORDS].numpy()
            assert (g[K.G_STEP], g[K.G_BASE], g[K.G_FIRST_SEQ], g[K.G_END_SEQ]) == \
                (ctrl.step, ctrl.base, ctrl.first_seq, ctrl.end_seq), i
        assert ring._head_next == (first + 2 * HEAD_SLOTS + 3) % HEAD_SLOTS
        # ... but not a slot whose step the device has not ended: the buffered path sends them then
        j = ring._head_next
        ring._head_seq[j] = ring.next_seq + 1000           # a step still in flight, as far as the ring knows
        ctrl = step(last.layout)
        assert ring._head_next == j
        g = ring.ctrl[:K.G_WORDS].numpy()
        assert (g[K.G_STEP], g[K.G_BASE], g[K.G_END_SEQ]) == (ctrl.step, ctrl.base, ctrl.end_seq)
        np.testing.assert_array_equal(site_words(ring.ctrl), want)
        ring._head_seq[j] = -1
        run.flush()
    print("control ok")


def _run_sections(results: Path, names: list[str]) -> None:
    """Each section in turn, from the environment and dynamo state the process started with; the
    outcomes written after each one (a crash keeps the earlier ones)."""
    import torch
    sections = {"kernel": section_kernel, "generate": section_generate, "wrap_null": section_wrap_null,
                "side": section_side, "side_generate": section_side_generate, "control": section_control,
                "stream": section_stream, "traced": section_traced, "rewrite": section_rewrite}
    done = {}
    for name in names:
        env = dict(os.environ)
        print(f"--- section {name}", flush=True)
        try:
            sections[name]()
            done[name] = ""
        except Exception:
            done[name] = traceback.format_exc()
            print(done[name], flush=True)
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch._dynamo.reset()
        results.write_text(json.dumps(done))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from conftest import settle_mkl_vml      # (a subprocess: pytest has not imported conftest here)
    settle_mkl_vml()
    _run_sections(Path(sys.argv[1]), sys.argv[2:])
