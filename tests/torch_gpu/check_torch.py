#!/usr/bin/env python3
"""PyTorch-on-GPU checks of ccalloc (a real GPU, PyTorch, a prebuilt libccalloc.so).

Run from anywhere on the GPU machine:

    CCALLOC_LIBRARY=$PWD/gpu/libccalloc.so PYTHONPATH=python python3 tests/torch_gpu/check_torch.py
    python3 tests/torch_gpu/check_torch.py cuda_graph oom_raises   # only these checks
    python3 tests/torch_gpu/check_torch.py -v                      # also show every child's output

CCALLOC_LIBRARY defaults to <repo>/gpu/libccalloc.so and <repo>/python is put on the children's
PYTHONPATH, so both settings are optional when run from a checkout.

Every check runs its PyTorch work in fresh child processes (``ccalloc.torch.enable()`` must run
before PyTorch initialises CUDA, and the allocator is process-global). The children are this
same file started with ``--child NAME --alloc native|ccalloc``; each ends with one line
``RESULT {json}`` that the parent reads.

Output: one line ``PASS name detail`` / ``FAIL name detail`` / ``SKIP name detail`` per check
(indented lines under it carry figures), then ``N passed, M failed, K skipped``. Exit status 1
when a check failed.

Checks: train_equal, allocated_matches_storages, record_stream, cuda_graph, cudnn_benchmark,
oom_raises, error_raises, ddp_two_gpus (needs 2 GPUs; skipped otherwise), and for the C++ backend
(ccalloc.torch's default mode): backend_mode, torch_stats, resnet_cudnn, snapshot,
snapshot_no_torch, log, compile_reduce_overhead, mempool, backend_vs_pluggable_time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYTHON_DIR = os.path.join(REPO, "python")
DEFAULT_LIBRARY = os.path.join(REPO, "gpu", "libccalloc.so")
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
CHILD_TIMEOUT = int(os.environ.get("CHECK_TORCH_TIMEOUT", "180"))
PLUGGABLE_CACHEINFO = "CUDAPluggableAllocator does not yet support cacheInfo"
MiB = 1 << 20


def r512(n: int) -> int:
    """ccalloc's block size for a request of n bytes (every block is a multiple of 512 B)."""
    return 0 if n <= 0 else (n + 511) // 512 * 512


def first_line(text: str, limit: int = 300) -> str:
    text = str(text).strip()
    line = text.splitlines()[0] if text else ""
    return line[:limit]


# ============================================================================================
# Child side: runs inside a fresh interpreter, does the PyTorch work, prints RESULT {json}.
# ============================================================================================


def make_convnet(nn):
    # Strided convolutions instead of pooling: every op has a deterministic CUDA backward.
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def params_digest(params) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in params:
        values = p.detach().float().cpu().flatten().tolist()
        h.update(struct.pack(f"<{len(values)}f", *values))
    return h.hexdigest()


def child_info(torch, alloc, args):
    import ccalloc

    torch.zeros(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    out = {
        "ok": True,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
        "device": props.name,
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "cudnn": torch.backends.cudnn.version(),
    }
    if alloc == "ccalloc":
        out.update(
            ccalloc_version=ccalloc.version(),
            ccalloc_library=ccalloc.library_path(),
            ccalloc_backend=ccalloc.backend(),
            ccalloc_conf=os.environ.get("CCALLOC_CONF", ""),
            enable_warnings=args.get("_enable_warnings", []),
            mode=args.get("_mode"),
        )
    return out


def child_train(torch, alloc, args):
    """20 deterministic training steps of a conv+MLP net; returns the per-step losses."""
    import torch.nn.functional as F

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    model = make_convnet(torch.nn).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = (64, 96, 32, 128, 80)  # varied shapes: the allocator sees changing sizes
    losses = []
    for step in range(int(args.get("steps", 20))):
        b = batches[step % len(batches)]
        x = torch.randn(b, 3, 32, 32, generator=gen).cuda()
        y = torch.randint(0, 10, (b,), generator=gen).cuda()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    out = {"ok": None, "losses": losses, "params_sha256": params_digest(model.parameters())}
    if alloc == "ccalloc":
        import ccalloc

        out["ccalloc_peak_allocated"] = ccalloc.max_memory_allocated()
        out["ccalloc_peak_reserved"] = ccalloc.max_memory_reserved()
    return out


def child_allocated(torch, alloc, args):
    """ccalloc.memory_allocated() == sum of live storages rounded up to 512 B, and
    requested_bytes.all.current == the raw sum, at several points."""
    import gc

    import ccalloc

    info = []
    ok = True
    torch.zeros(1, device="cuda")  # CUDA init; the tensor is freed at once
    torch.cuda.synchronize()

    def read():
        nonlocal ok
        torch.cuda.synchronize()
        s = ccalloc.memory_stats()
        if ccalloc.memory_allocated() != s["allocated_bytes.all.current"]:
            ok = False
            info.append(f"memory_allocated() {ccalloc.memory_allocated()} != allocated_bytes.all.current "
                        f"{s['allocated_bytes.all.current']}")
        return s["allocated_bytes.all.current"], s["requested_bytes.all.current"]

    def storages(tensors):
        seen = {}
        for t in tensors:
            if t is None or not t.is_cuda:
                continue
            st = t.untyped_storage()
            if st.nbytes() > 0:
                seen[st.data_ptr()] = st.nbytes()
        return seen

    def point(label, tensors, base):
        nonlocal ok
        allocated, requested = read()
        seen = storages(tensors)
        want_alloc = base[0] + sum(r512(n) for n in seen.values())
        want_req = base[1] + sum(seen.values())
        good = allocated == want_alloc and requested == want_req
        info.append(
            f"{label}: {len(seen)} storages; allocated {allocated} (expected {want_alloc}), "
            f"requested {requested} (expected {want_req}) {'ok' if good else 'MISMATCH'}"
        )
        if not good:
            ok = False
            # Which CUDA storages exist that the check does not hold? (diagnostics only)
            untracked = {}
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor) and obj.is_cuda:
                        st = obj.untyped_storage()
                        if st.data_ptr() not in seen and st.nbytes() > 0:
                            untracked[st.data_ptr()] = st.nbytes()
                except Exception:
                    pass
            if untracked:
                info.append(f"  untracked CUDA storages seen by gc: {sorted(untracked.values())[:20]}")
        return good

    base0 = read()
    if base0 != (0, 0):
        info.append(f"after CUDA init: allocated {base0[0]}, requested {base0[1]} (expected 0, 0)")
        ok = False

    # 0. Each size alone: the block counted for it is exactly round-up-512 (verifies the rule,
    #    small pool and large pool, with ccalloc's default paged segments).
    sizes = [1, 100, 511, 512, 513, 4095, 65536 + 1, MiB - 1, MiB, MiB + 1, 2 * MiB + 3,
             3 * MiB + 100, 10 * MiB, 10 * MiB + 1, 33 * MiB + 7, 100 * MiB + 513]
    off = []
    for n in sizes:
        before = read()
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        after = read()
        d_alloc, d_req = after[0] - before[0], after[1] - before[1]
        if d_alloc != r512(n) or d_req != n:
            off.append(f"{n}->alloc+{d_alloc}/req+{d_req} (expected +{r512(n)}/+{n})")
        del t
    if off:
        ok = False
        info.append("single sizes not round-up-512: " + ", ".join(off))
    else:
        info.append(f"single sizes: all {len(sizes)} sizes (1 B .. 100 MiB) counted as round-up-512, requested exact")
    base = read()
    if base != base0:
        ok = False
        info.append(f"after freeing the single-size tensors: {base} != {base0}")

    # 1. Assorted tensors (no matmul yet: cuBLAS would allocate its workspace).
    held = []
    held.append(torch.empty(7, dtype=torch.uint8, device="cuda"))
    held.append(torch.ones(3, 5, 7, device="cuda"))
    held.append(torch.zeros(513, dtype=torch.float16, device="cuda"))
    held.append(torch.full(((1 << 20) + 3,), 2, dtype=torch.int64, device="cuda"))  # 8 MiB + 24
    held.append(torch.empty(0, device="cuda"))  # no storage memory
    held.append(torch.rand(1000, 1000, device="cuda"))
    held.append(torch.arange(12345, device="cuda", dtype=torch.float64))
    held.append(torch.zeros(31, 17, dtype=torch.bool, device="cuda"))
    held.append(torch.randn(4096, 1031, device="cuda"))  # ~16 MiB + odd
    held.append(torch.cat([held[1].flatten(), held[5].flatten()[:777]]))
    held.append(held[5] * 2 + 1)
    held.append(held[5][:10, :10])  # a view: shares held[5]'s storage
    held.append(torch.empty(3 * MiB + 5, dtype=torch.uint8, device="cuda"))
    big = torch.empty(40 * MiB + 17, dtype=torch.uint8, device="cuda")
    view_of_big = big[:100]
    held.append(view_of_big)
    point("after creating assorted tensors", held + [big], base)

    # 2. Delete some; the view keeps big's whole storage alive.
    del big
    for i in (0, 2, 3, 6, 12):
        held[i] = None
    point("after deleting some (a view keeps a 40 MiB storage alive)", held, base)

    # 3. Forward/backward. A warm-up step first: cuBLAS/cuBLASLt keep a workspace per
    #    (handle, stream) allocated through the allocator and never freed; measure it once.
    net = torch.nn.Sequential(make_convnet(torch.nn), torch.nn.Linear(10, 1000)).cuda()

    def step(model):
        x = torch.randn(64, 3, 32, 32, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        return x, y, out, loss

    warm = step(net)
    del warm
    net.zero_grad(set_to_none=True)
    params = list(net.parameters())
    allocated, requested = read()
    seen = storages(held + params)
    workspace = (allocated - base[0] - sum(r512(n) for n in seen.values()),
                 requested - base[1] - sum(seen.values()))
    info.append(f"persistent library workspaces after the first forward/backward: allocated {workspace[0]} "
                f"B, requested {workspace[1]} B (cuBLAS/cuBLASLt; not tensors)")
    base3 = (base[0] + workspace[0], base[1] + workspace[1])
    x, y, out, loss = step(net)
    grads = [p.grad for p in params]
    point("after forward/backward (params, grads, input, output, loss)", held + params + grads + [x, y, out, loss], base3)

    # 4. Everything the check made is freed: back to the workspaces alone.
    del x, y, out, loss, grads, params, net, view_of_big
    held.clear()
    point("after deleting everything", [], base3)
    return {"ok": ok, "detail": "allocated == sum(round512(storage nbytes)), requested == sum(nbytes) at every point"
            if ok else "mismatch (see lines below)", "info": info}


def child_record_stream(torch, alloc, args):
    """A block freed after record_stream must not be reused before the recorded stream's work."""
    import ccalloc

    cycles = int(args.get("cycles", 1_000_000_000))  # ~0.5-0.6 s of torch.cuda._sleep on an H100
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    info = []

    def scenario(n, record):
        # Warm the side stream's cache first: with pages already mapped for these blocks, no
        # allocation below has to wait for memory held by the busy main stream.
        with torch.cuda.stream(side):
            warm = [torch.empty(n, device="cuda") for _ in range(8)]
        warm += [torch.empty(n, device="cuda") for _ in range(4)]  # and the main stream's (y)
        # Launch each kernel once too: CUDA loads kernels lazily, and a first load can wait
        # for the device, which would end the main stream's sleep early.
        (torch.full((n,), 1.5, device="cuda") * 2).fill_(-1.0)
        del warm
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            x = torch.full((n,), 1.5, device="cuda")  # allocated on (and owned by) the side stream
        main.wait_stream(side)
        torch.cuda._sleep(cycles)  # main stream: busy for a while ...
        y = x * 2  # ... then reads x
        ptr = x.data_ptr()
        nbytes = x.untyped_storage().nbytes()
        s0 = ccalloc.memory_stats()
        if record:
            x.record_stream(main)
        del x
        s1 = ccalloc.memory_stats()
        pending = (s1["active_bytes.all.current"] - s1["allocated_bytes.all.current"]) - (
            s0["active_bytes.all.current"] - s0["allocated_bytes.all.current"])
        zs, reused = [], []
        with torch.cuda.stream(side):  # the side stream is idle: these run at once
            for _ in range(4):
                z = torch.empty(n, device="cuda")
                z.fill_(-1.0)
                zs.append(z)
                reused.append(z.data_ptr() == ptr)
        side.synchronize()  # the fills are done ...
        main_busy = not main.query()  # ... while main still sleeps: early reuse would corrupt y
        torch.cuda.synchronize()
        correct = bool((y == 3.0).all().item())
        zs_ok = all(bool((z == -1.0).all().item()) for z in zs)
        # After the main stream's work has completed, the block may be reused again.
        with torch.cuda.stream(side):
            w = torch.empty(n, device="cuda")
        reused_later = w.data_ptr() == ptr
        del w, zs, y
        torch.cuda.synchronize()
        return dict(n_bytes=nbytes, pending=pending, reused_early=any(reused), main_busy=main_busy,
                    correct=correct, zs_ok=zs_ok, reused_after_sync=reused_later)

    ok = True
    for n in (64 * 1024, 4 * MiB):  # 256 KiB (small pool) and 16 MiB (large pool) float32
        r = scenario(n, record=True)
        good = r["correct"] and r["zs_ok"] and not r["reused_early"]
        if not r["main_busy"]:
            info.append(f"{r['n_bytes']} B: main stream was already idle when the side-stream fills "
                        f"ended: the check proves nothing (raise --cycles)")
            good = False
        info.append(
            f"{r['n_bytes']} B: consumer result correct={r['correct']}, new tensors intact={r['zs_ok']}, "
            f"reused while pending={r['reused_early']}, main busy during fills={r['main_busy']}, "
            f"active-allocated while pending={r['pending']} (expected {r512(r['n_bytes'])}), "
            f"reused after sync={r['reused_after_sync']}")
        if r["pending"] != r512(r["n_bytes"]):
            info.append(f"  stats: active - allocated grew by {r['pending']}, expected {r512(r['n_bytes'])}")
            good = False
        ok = ok and good
    # Control without record_stream: shows the scenario detects early reuse (not a failure).
    c = scenario(4 * MiB, record=False)
    info.append(f"control without record_stream (unsafe on purpose): reused at once={c['reused_early']}, "
                f"consumer corrupted={not c['correct']}"
                + (" -> the scenario does detect early reuse" if c["reused_early"] and not c["correct"] else ""))
    return {"ok": ok, "detail": "no reuse before the recorded stream's work; results intact" if ok
            else "see lines below", "info": info}


def child_cuda_graph(torch, alloc, args):
    import gc
    import math

    import ccalloc

    nn = torch.nn
    torch.manual_seed(0)
    B = 1024
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.LayerNorm(2048), nn.Linear(2048, 2048),
                          nn.ReLU(), nn.Linear(2048, 512)).cuda().eval()
    static_in = torch.randn(B, 1024, device="cuda")
    # Warm-up on a side stream, as torch.cuda.graph's documentation does.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    with torch.no_grad():
        model(static_in)  # also on the default stream: cuBLAS makes its workspace for it now, not later
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    r0, a0 = ccalloc.memory_reserved(), ccalloc.memory_allocated()

    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_out = model(static_in)
    torch.cuda.synchronize()
    r1, a1 = ccalloc.memory_reserved(), ccalloc.memory_allocated()

    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(B, 1024, generator=gen).cuda() for _ in range(6)]
    junk_sizes = [B * 2048, B * 512, B * 1024, 4096, B * 2048 + 77, 3 * MiB]
    nan = float("nan")
    info, ok, worst = [], True, 0.0
    for i, inp in enumerate(inputs):
        # Fresh allocations before the replay: must not lie in the graph's private pool.
        junk = [torch.empty(n, device="cuda").fill_(nan) for n in junk_sizes]
        static_in.copy_(inp)
        g.replay()
        # ... and after it, before the output is read: must not overlap the graph's output.
        junk2 = [torch.empty(n, device="cuda").fill_(nan) for n in junk_sizes]
        torch.cuda.synchronize()
        with torch.no_grad():
            ref = model(inp)
        diff = (static_out - ref).abs().max().item()
        close = torch.allclose(static_out, ref, rtol=1e-4, atol=1e-5) and not math.isnan(diff)
        intact = all(bool(torch.isnan(j).all().item()) for j in junk + junk2)
        worst = nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)
        if not (close and intact):
            ok = False
            info.append(f"replay {i}: allclose={close} (max abs diff {diff}), other tensors intact={intact}")
        del junk, junk2, ref
    torch.cuda.synchronize()

    del g, static_out
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    r2, a2 = ccalloc.memory_reserved(), ccalloc.memory_allocated()
    info.append(f"reserved: before capture {r0 / MiB:.1f} MiB, with graph {r1 / MiB:.1f} MiB, "
                f"after del graph + empty_cache {r2 / MiB:.1f} MiB; allocated before capture {a0}, "
                f"with graph {a1}, after {a2} (leftover {a2 - a0} B: library workspaces made during capture, if any)")
    info.append(f"{len(inputs)} replays with allocations between them: max |graph - eager| = {worst:g}")
    # Library workspaces created meanwhile stay allocated; what must go is the graph's cached
    # memory: after empty_cache, reserved may exceed allocated only by partial pages.
    cached_with_graph, cached_after = r1 - a1, r2 - a2
    released = cached_after < max(cached_with_graph, 1) or cached_after <= 8 * MiB
    info.append(f"cached (reserved - allocated): with graph {cached_with_graph / MiB:.1f} MiB, "
                f"after {cached_after / MiB:.1f} MiB")
    if not released:
        ok = False
        info.append("the graph's memory stayed cached after deleting the graph and emptying the cache")
    if r1 <= r0:
        info.append("note: capture did not grow reserved memory (pool served from cache?)")
    detail = (f"{len(inputs)} replays match eager (max diff {worst:g}); graph pool freed: reserved "
              f"{r1 / MiB:.0f} -> {r2 / MiB:.0f} MiB") if ok else "see lines below"
    return {"ok": ok, "detail": detail, "info": info}


def child_cudnn_benchmark(torch, alloc, args):
    import math
    import re

    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = make_convnet(torch.nn).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    try:
        for step in range(6):
            b = (64, 32)[step % 2]  # two shapes: benchmarking runs for each
            x = torch.randn(b, 3, 32, 32, device="cuda")
            y = torch.randint(0, 10, (b,), device="cuda")
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the text decides
        text = first_line(str(e), 400)
        known = re.search(re.escape(PLUGGABLE_CACHEINFO), str(e)) is not None
        return {"ok": known, "detail": f"raises: {text}" if known else f"unexpected {type(e).__name__}: {text}",
                "info": [f"exception type {type(e).__name__}; steps done before it: {len(losses)}"]}
    finite = all(math.isfinite(v) for v in losses)
    return {"ok": finite, "detail": f"{len(losses)} steps, losses {['%.4f' % v for v in losses]}"}


def child_oom(torch, alloc, args):
    import ccalloc

    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 0.05
    torch.cuda.set_per_process_memory_fraction(fraction)
    info = [f"device memory {total / 2**30:.1f} GiB; fraction set to {fraction} "
            f"(ccalloc reads back {ccalloc.get_per_process_memory_fraction()})"]
    ok = ccalloc.get_per_process_memory_fraction() == fraction
    ooms_before = ccalloc.memory_stats()["num_ooms"]
    observed = []
    backend = args.get("_mode") == "backend"
    if backend:
        torch._C._cuda_attach_out_of_memory_observer(
            lambda device, allocated, total, free: observed.append((device, allocated, total, free)))
    size = int(total * 0.10)
    raised = None
    try:
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        info.append(f"allocating {size} B did NOT raise (data_ptr {t.data_ptr()})")
        del t
    except Exception as e:  # noqa: BLE001
        raised = e
    if raised is not None:
        text = first_line(str(raised), 300)
        good = isinstance(raised, RuntimeError) and "out of memory" in str(raised).lower()
        info.append(f"raised {type(raised).__name__}: {text}")
        if backend:
            is_oom_error = isinstance(raised, torch.OutOfMemoryError)
            says = all(w in str(raised) for w in ("reserved", "live", "largest free block"))
            info.append(f"torch.OutOfMemoryError: {is_oom_error}; message names reserved, live and the "
                        f"largest free block: {says}; OOM observer calls: {observed}")
            limit = int(total * fraction)
            good = (good and is_oom_error and says and len(observed) == 1 and observed[0][1] == size
                    and abs(observed[0][2] - limit) <= 1)
        ok = ok and good
    else:
        ok = False
    ooms = ccalloc.memory_stats()["num_ooms"] - ooms_before
    info.append(f"num_ooms grew by {ooms}")
    ok = ok and ooms >= 1
    # Still usable: a small tensor, and one just under the limit.
    small = torch.ones(1024, device="cuda")
    small_ok = small.sum().item() == 1024.0
    under = torch.ones(int(total * 0.02) // 4, device="cuda")
    under_ok = under[-1].item() == 1.0
    info.append(f"small allocation after OOM works={small_ok}; 2% of memory works={under_ok}")
    ok = ok and small_ok and under_ok
    detail = (f"{type(raised).__name__}: {first_line(str(raised), 160)}" if ok else "see lines below")
    return {"ok": ok, "detail": detail, "info": info}


def child_ddp_worker(torch, alloc, args):
    """One rank of a 2-process DDP run (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, allocated, other = [], [], []
    for step in range(8):
        x = torch.randn(64 + 16 * (step % 3), 128, generator=gen).cuda()
        y = torch.randint(0, 10, (x.shape[0],), generator=gen).cuda()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if alloc == "ccalloc":
            import ccalloc

            allocated.append(ccalloc.memory_allocated(device=rank))
            other.append(ccalloc.memory_allocated(device=1 - rank))
        if step < 7:
            opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    grads = torch.cat([p.grad.detach().flatten() for p in model.parameters()]).cpu()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    values = grads.tolist() + params.tolist()
    with open(args["out"], "wb") as f:
        f.write(struct.pack(f"<{len(values)}f", *values))
    dist.barrier()
    dist.destroy_process_group()
    return {"ok": True, "rank": rank, "losses": losses, "n_grads": grads.numel(), "n_params": params.numel(),
            "ccalloc_allocated": allocated, "ccalloc_allocated_other_device": other,
            "digest": params_digest([grads, params])}


def child_torch_stats(torch, alloc, args):
    """torch.cuda's statistics calls give ccalloc's figures (the backend mode)."""
    import ccalloc

    if args.get("_mode") != "backend":
        return {"ok": False, "detail": f"needs the backend mode, got {args.get('_mode')}"}
    keep = [torch.empty(n, device="cuda") for n in (1, 1000, 1 << 18, 3 << 20, 50 << 20)]
    del keep[1]
    torch.cuda.synchronize()
    info, ok = [], True
    theirs, ours = torch.cuda.memory_stats(), ccalloc.memory_stats()
    common = sorted(set(theirs) & set(ours))
    differ = [k for k in common if theirs[k] != ours[k]]
    info.append(f"{len(common)} keys in both; differing: {differ[:10]}")
    ok = ok and len(common) >= 60 and not differ
    pairs = [
        ("memory_allocated", torch.cuda.memory_allocated(), ccalloc.memory_allocated()),
        ("memory_reserved", torch.cuda.memory_reserved(), ccalloc.memory_reserved()),
        ("max_memory_allocated", torch.cuda.max_memory_allocated(), ccalloc.max_memory_allocated()),
        ("max_memory_reserved", torch.cuda.max_memory_reserved(), ccalloc.max_memory_reserved()),
    ]
    for name, t, c in pairs:
        info.append(f"{name}: torch {t}, ccalloc {c}")
        ok = ok and t == c and t > 0
    peak = torch.cuda.max_memory_allocated()
    del keep
    torch.cuda.reset_peak_memory_stats()
    after = torch.cuda.max_memory_allocated()
    info.append(f"reset_peak_memory_stats: peak {peak} -> {after} (ccalloc {ccalloc.max_memory_allocated()})")
    ok = ok and after < peak and after == ccalloc.max_memory_allocated()
    summary = torch.cuda.memory_summary()
    ok = ok and "Allocated memory" in summary and "ccalloc" not in summary[:0]
    info.append(f"memory_summary: {len(summary.splitlines())} lines")
    torch.cuda.empty_cache()
    info.append(f"after empty_cache: reserved torch {torch.cuda.memory_reserved()}, ccalloc {ccalloc.memory_reserved()}")
    ok = ok and torch.cuda.memory_reserved() == ccalloc.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(0.5)
    frac = ccalloc.get_per_process_memory_fraction()
    ok = ok and frac == 0.5
    info.append(f"set_per_process_memory_fraction(0.5): ccalloc reads {frac}")
    detail = f"{len(common)} memory_stats keys equal; allocated/reserved/max/reset/summary/fraction agree" if ok else "see lines below"
    return {"ok": ok, "detail": detail, "info": info}


def child_resnet_cudnn(torch, alloc, args):
    """ResNet-50 training with cudnn.benchmark (cuDNN asks the allocator's cacheInfo)."""
    import math

    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for step in range(4):
        b = (64, 48)[step % 2]
        x = torch.randn(b, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    info = [f"losses {['%.4f' % v for v in losses]}"]
    ok = all(math.isfinite(v) for v in losses)
    if alloc == "ccalloc":
        import ccalloc

        largest = ccalloc.cache_info()
        info.append(f"cacheInfo (largest cached block) {largest / MiB:.1f} MiB; reserved "
                    f"{ccalloc.memory_reserved() / MiB:.0f} MiB, peak allocated {ccalloc.max_memory_allocated() / MiB:.0f} MiB")
        ok = ok and 0 < largest <= ccalloc.memory_reserved()
    return {"ok": ok, "detail": f"{len(losses)} steps with cudnn.benchmark" if ok else "see lines below", "info": info}


def child_snapshot(torch, alloc, args):
    """_record_memory_history / _dump_snapshot through PyTorch's API; the viewer reads it."""
    import pickle

    out_dir = args["dir"]
    torch.cuda.memory._record_memory_history(max_entries=100000)
    x = torch.randn(1024, 1024, device="cuda")
    ys = [x @ x for _ in range(4)]
    del ys[0]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        z = torch.empty(5 << 20, device="cuda")
    z.record_stream(torch.cuda.current_stream())
    del z
    torch.cuda.synchronize()
    path = os.path.join(out_dir, f"{alloc}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    actions = sorted({e["action"] for e in trace})
    with_frames = sum(1 for e in trace if e["action"] == "alloc" and e.get("frames"))
    allocs = sum(1 for e in trace if e["action"] == "alloc")
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    live_with_frames = sum(1 for b in blocks if b["state"] == "active_allocated" and b.get("frames"))
    info = [f"{len(snap['segments'])} segments, {len(blocks)} blocks ({live_with_frames} live with frames); "
            f"{len(trace)} events {actions}; allocs with frames {with_frames}/{allocs}"]
    ok = allocs >= 5 and with_frames == allocs and live_with_frames >= 3 and "free_completed" in actions
    for kind in ("trace_plot", "segment_plot"):
        html = os.path.join(out_dir, f"{alloc}_{kind}.html")
        p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", kind, path, "-o", html],
                           capture_output=True, text=True, timeout=120)
        size = os.path.getsize(html) if os.path.exists(html) else 0
        info.append(f"_memory_viz {kind}: exit {p.returncode}, {size} bytes {first_line(p.stderr)}")
        ok = ok and p.returncode == 0 and size > 10000
    tool = os.path.join(REPO, "gpu", "ccalloc")
    if alloc == "ccalloc" and os.path.exists(tool):
        p = subprocess.run([tool, "replay", path], capture_output=True, text=True, timeout=120)
        info.append(f"ccalloc replay: exit {p.returncode}: {first_line(p.stdout.splitlines()[-1] if p.stdout.strip() else p.stderr)}")
        ok = ok and p.returncode == 0
    return {"ok": ok, "detail": f"{len(trace)} events, frames on every alloc, viewer and replay read it" if ok else "see lines below",
            "info": info}


def child_snapshot_no_torch(torch, alloc, args):
    """ccalloc.memory's own history and snapshot (C API, no torch allocator involved)."""
    import pickle

    import ccalloc
    import ccalloc.memory

    out_dir = args["dir"]
    ccalloc.memory._record_memory_history(max_entries=10000)
    ptrs = [ccalloc.malloc(n) for n in (512, 3 << 20, 40 << 20)]
    ccalloc.free(ptrs.pop(0))
    path = os.path.join(out_dir, "no_torch.pickle")
    ccalloc.memory._dump_snapshot(path)
    ccalloc.memory._record_memory_history(enabled=None)
    for p in ptrs:
        ccalloc.free(p)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    actions = [e["action"] for e in snap["device_traces"][0]]
    info = [f"events {actions}"]
    ok = actions.count("alloc") == 3 and "free_completed" in actions and snap["segments"]
    html = os.path.join(out_dir, "no_torch_trace.html")
    p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", path, "-o", html],
                       capture_output=True, text=True, timeout=120)
    info.append(f"_memory_viz trace_plot: exit {p.returncode} {first_line(p.stderr)}")
    ok = bool(ok) and p.returncode == 0
    return {"ok": ok, "detail": f"{len(actions)} events written by the C library; the viewer reads them" if ok else "see lines below",
            "info": info}


def child_log(torch, alloc, args):
    """CCALLOC_LOG=debug (set by the parent): ccalloc's events reach stderr."""
    x = torch.empty(64 << 20, device="cuda")
    del x
    torch.cuda.empty_cache()
    return {"ok": True, "detail": "ran"}


def child_compile(torch, alloc, args):
    """torch.compile(mode="reduce-overhead"): CUDA graph trees for training and inference."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(8):
        x = torch.randn(128, 256, generator=gen).cuda()
        y = torch.randint(0, 10, (128,), generator=gen).cuda()
        loss = nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    outs = []
    with torch.no_grad():
        model.eval()
        infer = torch.compile(model, mode="reduce-overhead")
        for _ in range(6):
            x = torch.randn(64, 256, generator=gen).cuda()
            outs.append(infer(x).sum().item())
    torch.cuda.synchronize()
    return {"ok": None, "losses": losses, "outputs": outs}


def child_mempool(torch, alloc, args):
    """torch.cuda.MemPool / use_mem_pool route allocations to a private pool."""
    import ccalloc.memory

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(8 << 20, device="cuda")
        b = torch.ones(1000, device="cuda")
    c = torch.empty(8 << 20, device="cuda")
    pool_id = tuple(pool.id)
    snap = ccalloc.memory._snapshot()
    owner = {}
    for seg in snap["segments"]:
        addr = seg["address"]
        for blk in seg["blocks"]:
            owner[blk["address"]] = tuple(seg["segment_pool_id"])
            addr += blk["size"]
    in_pool = [owner.get(t.data_ptr()) == pool_id for t in (a, b)]
    outside = owner.get(c.data_ptr()) != pool_id
    use_count = pool.use_count() if hasattr(pool, "use_count") else "n/a"
    try:
        pool_segments = len(torch.cuda.memory_snapshot(pool.id))
    except TypeError:
        pool_segments = "n/a"
    info = [f"pool {pool_id}: a, b in pool {in_pool}; c outside {outside}; use_count {use_count}; "
            f"snapshot(pool) segments {pool_segments}"]
    ok = all(in_pool) and outside and b.sum().item() == 1000.0
    del a, b, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"ok": ok, "detail": "MemPool allocations land in the pool, others outside" if ok else "see lines below", "info": info}


def child_timing(torch, alloc, args):
    """Steady-state step time of a small training loop (for the backend vs pluggable pairing)."""
    import time as _time

    nn = torch.nn
    torch.manual_seed(0)
    model = make_convnet(nn).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = (64, 96, 32, 128, 80)
    times = []
    for step in range(int(args.get("steps", 300))):
        b = batches[step % len(batches)]
        t0 = _time.perf_counter()
        x = torch.randn(b, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (b,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(_time.perf_counter() - t0)
    steady = sorted(times[50:])
    return {"ok": True, "median_us": steady[len(steady) // 2] * 1e6, "mode": args.get("_mode")}


def child_managed_tensor(torch, alloc, args):
    """A managed buffer as a CUDA tensor (__cuda_array_interface__), prefetched and advised,
    and a pinned buffer as a NumPy array copied to the device: no PyTorch allocator involved."""
    import numpy

    import ccalloc

    n = 1 << 20
    buf = ccalloc.managed_empty((n,), "float32")
    ccalloc.advise(buf, ccalloc.Advice.SET_PREFERRED_LOCATION, 0)
    ccalloc.prefetch(buf, 0)
    t = torch.as_tensor(buf, device="cuda")
    t.fill_(2.0)
    t.mul_(3.0)
    torch.cuda.synchronize()
    ccalloc.prefetch(buf, -1)
    torch.cuda.synchronize()
    host_view = numpy.asarray(buf)
    managed_ok = t.data_ptr() == host_view.ctypes.data and bool((host_view == 6.0).all())
    pinned = ccalloc.pinned_empty((n,), "float32")
    arr = numpy.asarray(pinned)
    arr[:] = numpy.arange(n, dtype=numpy.float32)
    on_device = torch.from_numpy(arr).to("cuda", non_blocking=True)
    ccalloc.host_record_stream(pinned, torch.cuda.current_stream().cuda_stream)
    total = on_device.sum().item()
    pinned_ok = total == float(numpy.arange(n, dtype=numpy.float64).sum())
    stats = ccalloc.managed_memory_stats()
    del t, host_view, arr, on_device
    buf.close()
    pinned.close()
    info = [f"managed tensor shares the buffer and reads back 6.0 on the host: {managed_ok}; "
            f"pinned NumPy array copied to the device sums right: {pinned_ok}; managed stats "
            f"{ {k: v for k, v in stats.items() if k.endswith('.current')} }"]
    ok = managed_ok and pinned_ok
    return {"ok": ok, "detail": "managed buffer as a CUDA tensor, pinned buffer as a NumPy source" if ok else "see lines below",
            "info": info}


def child_error_raises(torch, alloc, args):
    """A failed allocation other than an OOM raises a RuntimeError naming the status: after
    ccalloc.shutdown(), torch.empty must raise, not crash the process."""
    import ccalloc

    torch.cuda.init()
    ccalloc.shutdown()
    raised = None
    try:
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001
        raised = e
    text = first_line(str(raised), 300) if raised is not None else "nothing raised"
    ok = isinstance(raised, RuntimeError) and "CCALLOC_SHUT_DOWN" in str(raised)
    ccalloc.init()
    after = torch.ones(1024, device="cuda").sum().item() == 1024.0
    info = [f"after shutdown: {type(raised).__name__}: {text}", f"after init again: works={after}"]
    return {"ok": ok and after, "detail": text if ok else "see lines below", "info": info}


def child_threads_own_streams(torch, alloc, args):
    """Threads each training on a stream of its own (by default each gets a shard), backward
    on autograd's thread: the same losses as one thread running them in turn, and statistics
    read meanwhile never show more allocated than reserved."""
    import threading

    nn = torch.nn
    threads = int(args.get("threads", 4))
    steps = int(args.get("steps", 40))

    def train(seed, out):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            g = torch.Generator(device="cuda").manual_seed(seed)
            model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                  nn.Linear(1024, 10)).cuda()
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for step in range(steps):
                x = torch.randn(32 + 8 * (step % 9), 256, generator=g, device="cuda")
                loss = model(x).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            stream.synchronize()
            out[seed] = [float(v) for v in losses]

    alone = {}
    for seed in range(1, threads + 1):
        train(seed, alone)
    together, errors = {}, []

    def guarded(seed):
        try:
            train(seed, together)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {seed}: {type(e).__name__}: {first_line(str(e))}")

    workers = [threading.Thread(target=guarded, args=(seed,)) for seed in range(1, threads + 1)]
    for w in workers:
        w.start()
    reads, bad_reads = 0, []
    while any(w.is_alive() for w in workers):
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        reads += 1
        if allocated > reserved:
            bad_reads.append((allocated, reserved))
    for w in workers:
        w.join()
    torch.cuda.synchronize()
    # cuBLAS may reduce in another order on several streams (PyTorch's reproducibility
    # notes), hence a tolerance; a block reused while another stream still used it would
    # corrupt far more.
    differ = [s for s in alone if together.get(s) is None
              or max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(alone[s], together[s])) > 1e-3]
    info = [f"{threads} threads x {steps} steps; {reads} statistics reads meanwhile",
            f"final losses alone {[round(alone[s][-1], 6) for s in sorted(alone)]}",
            f"final losses together {[round(together[s][-1], 6) for s in sorted(together)]}"]
    if alloc == "ccalloc":
        import ccalloc

        theirs, ours = torch.cuda.memory_stats(), ccalloc.memory_stats()
        differing = [k for k in sorted(set(theirs) & set(ours)) if theirs[k] != ours[k]]
        info.append(f"torch.cuda.memory_stats vs ccalloc: differing {differing[:5]}")
        errors += [f"memory_stats differ: {differing[:5]}"] if differing and args.get("_mode") == "backend" else []
    ok = not errors and not differ and not bad_reads and reads > 0
    detail = (f"{threads} threads on their own streams: losses equal to one thread's, "
              f"{reads} reads never allocated > reserved") if ok else \
        f"errors {errors[:2]}; losses differ for {differ}; bad reads {bad_reads[:3]}"
    return {"ok": ok, "detail": detail, "info": info}


CHILDREN = {
    "info": child_info,
    "error_raises": child_error_raises,
    "train": child_train,
    "allocated": child_allocated,
    "record_stream": child_record_stream,
    "cuda_graph": child_cuda_graph,
    "cudnn_benchmark": child_cudnn_benchmark,
    "oom": child_oom,
    "ddp_worker": child_ddp_worker,
    "torch_stats": child_torch_stats,
    "resnet_cudnn": child_resnet_cudnn,
    "snapshot": child_snapshot,
    "snapshot_no_torch": child_snapshot_no_torch,
    "log": child_log,
    "compile": child_compile,
    "mempool": child_mempool,
    "timing": child_timing,
    "managed_tensor": child_managed_tensor,
    "threads_own_streams": child_threads_own_streams,
}


def child_main(name: str, alloc: str, args: dict) -> int:
    result = None
    try:
        if alloc == "ccalloc":
            import warnings

            import ccalloc.torch

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                args["_mode"] = ccalloc.torch.enable()
            args["_enable_warnings"] = [str(w.message) for w in caught]
            for w in caught:
                print(f"warning from enable(): {w.message}", file=sys.stderr)
        import torch

        if not torch.cuda.is_available():
            result = {"ok": False, "detail": "PyTorch sees no CUDA device", "no_cuda": True}
        else:
            result = CHILDREN[name](torch, alloc, args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        result = {"ok": False, "detail": f"{type(e).__name__}: {first_line(str(e))}", "crashed": True}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ============================================================================================
# Parent side: starts the children, judges, prints the summary.
# ============================================================================================

VERBOSE = False


def child_env(extra=None):
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not env.get("CCALLOC_LIBRARY") and os.path.exists(DEFAULT_LIBRARY):
        env["CCALLOC_LIBRARY"] = DEFAULT_LIBRARY
    env["CCALLOC_BACKEND"] = "cuda"
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # native runs use PyTorch's defaults
    env.update(extra or {})
    return env


def child_cmd(name, alloc, args=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--alloc", alloc]
    for k, v in (args or {}).items():
        cmd += ["--arg", f"{k}={v}"]
    return cmd


def parse_result(stdout):
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[len("RESULT "):])
            except ValueError:
                return None
    return None


def tail(text, n=15):
    lines = [l for l in text.splitlines() if l.strip()]
    return "\n".join("    | " + l for l in lines[-n:])


def show_output(label, proc_out, proc_err):
    if VERBOSE:
        print(f"    --- {label} stdout ---")
        print(tail(proc_out, 200))
        print(f"    --- {label} stderr ---")
        print(tail(proc_err, 200))


def run_child(name, alloc, args=None, timeout=CHILD_TIMEOUT, env=None):
    """Runs one child; returns (result or None, note). note explains a missing result."""
    t0 = time.time()
    try:
        p = subprocess.run(child_cmd(name, alloc, args), env=child_env(env), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        show_output(f"{name}/{alloc}", out, err)
        return None, f"{name}/{alloc} timed out after {timeout}s\n{tail(err)}"
    show_output(f"{name}/{alloc} ({time.time() - t0:.1f}s)", p.stdout, p.stderr)
    result = parse_result(p.stdout)
    if result is None:
        return None, f"{name}/{alloc}: no RESULT line, exit status {p.returncode}\n{tail(p.stderr)}"
    if result.get("crashed") or (p.returncode != 0):
        result.setdefault("info", []).append(f"child exit status {p.returncode}; stderr tail:\n{tail(p.stderr)}")
    return result, ""


def from_child(name, alloc="ccalloc", args=None):
    result, note = run_child(name, alloc, args)
    if result is None:
        return "FAIL", first_line(note), note.splitlines()[1:]
    status = "PASS" if result.get("ok") else "FAIL"
    return status, result.get("detail", ""), result.get("info", [])


def check_train_equal():
    runs = {}
    for alloc in ("native", "ccalloc"):
        result, note = run_child("train", alloc)
        if result is None or result.get("crashed") or "losses" not in result:
            text = note or (result or {}).get("detail", "")
            return "FAIL", f"{alloc} run failed: {first_line(text)}", (note.splitlines()[1:] if note else (result or {}).get("info", []))
        runs[alloc] = result
    a, b = runs["native"]["losses"], runs["ccalloc"]["losses"]
    info = [f"native  losses: {a}", f"ccalloc losses: {b}"]
    same_params = runs["native"]["params_sha256"] == runs["ccalloc"]["params_sha256"]
    info.append(f"final parameters bitwise equal: {same_params}")
    if a == b and same_params:
        return "PASS", f"{len(a)} steps, losses and final parameters bitwise equal", info
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return "FAIL", f"differ (first differing step: {diffs[0] if diffs else 'none; params differ'})", info


def check_allocated():
    return from_child("allocated")


def check_record_stream():
    return from_child("record_stream")


def check_cuda_graph():
    return from_child("cuda_graph")


def check_cudnn_benchmark():
    return from_child("cudnn_benchmark")


def check_oom():
    return from_child("oom")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_floats(path):
    with open(path, "rb") as f:
        data = f.read()
    return struct.unpack(f"<{len(data) // 4}f", data)


def run_ddp(alloc, tmpdir, world=2, timeout=CHILD_TIMEOUT, extra_env=None, tag=""):
    port = free_port()
    procs = []
    for rank in range(world):
        env = child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra_env or {})})
        out = os.path.join(tmpdir, f"{alloc}{tag}_{rank}.bin")
        procs.append((subprocess.Popen(child_cmd("ddp_worker", alloc, {"out": out}), env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out))
    results, notes = [], []
    deadline = time.time() + timeout
    for rank, (p, out) in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            notes.append(f"{alloc} rank {rank} timed out\n{tail(se)}")
            results.append(None)
            continue
        show_output(f"ddp {alloc} rank {rank}", so, se)
        r = parse_result(so)
        if r is None or not r.get("ok"):
            notes.append(f"{alloc} rank {rank}: {(r or {}).get('detail', 'no RESULT line')} (exit {p.returncode})\n{tail(se)}")
            results.append(None)
        else:
            r["values"] = read_floats(out)
            results.append(r)
    return results, notes


def check_ddp(device_count):
    if device_count is None:
        return "FAIL", "could not learn the device count (the info child failed)", []
    if device_count < 2:
        return "SKIP", f"only {device_count} GPU(s)", []
    info = []
    with tempfile.TemporaryDirectory(prefix="ccalloc_ddp_") as tmpdir:
        runs = {}
        for alloc in ("native", "ccalloc"):
            results, notes = run_ddp(alloc, tmpdir)
            if notes:
                return "FAIL", f"{alloc} DDP run failed", sum((n.splitlines() for n in notes), [])
            runs[alloc] = results
    ok = True
    for alloc, (r0, r1) in runs.items():
        same = r0["values"] == r1["values"]
        info.append(f"{alloc}: rank 0 and rank 1 grads+params equal: {same}; rank 0 losses {['%.5f' % v for v in r0['losses']]}")
        ok = ok and same
    n, c = runs["native"][0], runs["ccalloc"][0]
    if n["values"] == c["values"]:
        info.append("native vs ccalloc: final grads and params bitwise equal")
        verdict = "bitwise equal to native"
    else:
        diff = max(abs(x - y) for x, y in zip(n["values"], c["values"]))
        scale = max(1e-12, max(abs(x) for x in n["values"]))
        close = diff <= 1e-5 * scale + 1e-6
        info.append(f"native vs ccalloc: not bitwise equal; max abs diff {diff:g} (max |value| {scale:g}); close={close}")
        ok = ok and close
        verdict = f"within {diff:g} of native (not bitwise)"
    for rank, r in enumerate(runs["ccalloc"]):
        allocs = r["ccalloc_allocated"]
        good = bool(allocs) and all(v > 0 for v in allocs)
        info.append(f"ccalloc rank {rank}: memory_allocated(device={rank}) during training {allocs}; "
                    f"on the other device {r['ccalloc_allocated_other_device']}")
        ok = ok and good
    # NCCL's register hook sees segments through the backend's trace trackers (PyTorch 2.11
    # turns the hook off with expandable segments: plain segments here).
    with tempfile.TemporaryDirectory(prefix="ccalloc_ddp_hook_") as tmpdir:
        hook_env = {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1", "CCALLOC_CONF": "expandable_segments:False"}
        results, notes = run_ddp("ccalloc", tmpdir, extra_env=hook_env, tag="_hook")
    if notes:
        return "FAIL", "DDP with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 failed", sum((n.splitlines() for n in notes), [])
    hook_same = results[0]["values"] == runs["native"][0]["values"]
    info.append(f"with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 (plain segments): equal to native {hook_same}")
    ok = ok and hook_same
    return ("PASS" if ok else "FAIL"), (f"2 ranks, {verdict}; per-device allocated > 0; NCCL register hook run" if ok else "see lines below"), info


def check_backend_mode():
    result, note = run_child("info", "ccalloc", timeout=600)
    if result is None:
        return "FAIL", first_line(note), note.splitlines()[1:]
    mode = result.get("mode")
    return ("PASS" if mode == "backend" else "FAIL"), f"ccalloc.torch.enable() -> {mode!r}", result.get("enable_warnings", [])


def check_torch_stats():
    return from_child("torch_stats")


def check_resnet_cudnn():
    return from_child("resnet_cudnn")


def check_snapshot():
    with tempfile.TemporaryDirectory() as d:
        return from_child("snapshot", args={"dir": d})


def check_snapshot_no_torch():
    # PyTorch keeps its own allocator here: ccalloc is used through its C API alone.
    with tempfile.TemporaryDirectory() as d:
        return from_child("snapshot_no_torch", alloc="native", args={"dir": d})


def check_log():
    p = subprocess.run(child_cmd("log", "ccalloc"), env=child_env({"CCALLOC_LOG": "debug"}), capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT)
    silent_env = child_env()
    silent_env.pop("CCALLOC_LOG", None)
    quiet = subprocess.run(child_cmd("log", "ccalloc"), env=silent_env, capture_output=True, text=True,
                           timeout=CHILD_TIMEOUT)
    found = [w for w in ("ccalloc initialized", "segment_map", "segment_unmap") if w in p.stderr]
    info = [f"with CCALLOC_LOG=debug, stderr has {found}", f"without: {len(quiet.stderr.strip())} bytes on stderr"]
    ok = len(found) == 3 and "segment_map" not in quiet.stderr
    return ("PASS" if ok else "FAIL"), "ccalloc's events reach stderr when asked, none otherwise", info


def check_compile():
    runs = {}
    for alloc in ("native", "ccalloc"):
        result, note = run_child("compile", alloc, timeout=600)
        if result is None or result.get("crashed") or "losses" not in result:
            text = note or (result or {}).get("detail", "")
            return "FAIL", f"{alloc} run failed: {first_line(text)}", (note.splitlines()[1:] if note else (result or {}).get("info", []))
        runs[alloc] = result
    a, b = runs["native"], runs["ccalloc"]
    info = [f"native  losses {a['losses']}", f"ccalloc losses {b['losses']}",
            f"inference sums equal: {a['outputs'] == b['outputs']}"]
    ok = a["losses"] == b["losses"] and a["outputs"] == b["outputs"]
    return ("PASS" if ok else "FAIL"), ("8 training + 6 inference steps with CUDA graph trees, bit-equal to native"
                                        if ok else "differ from native"), info


def check_mempool():
    return from_child("mempool")


def check_backend_time():
    """Paired, interleaved rounds: backend vs pluggable, steady-state median step time. A
    measurement (INFO), not a check: it fails only when a run fails."""
    ratios, info = [], []
    for r in range(int(os.environ.get("TIMING_ROUNDS", "5"))):
        medians = {}
        for mode in (("backend", "pluggable") if r % 2 == 0 else ("pluggable", "backend")):
            result, note = run_child("timing", "ccalloc", env={"CCALLOC_TORCH_MODE": mode}, timeout=600)
            if result is None or "median_us" not in result:
                return "FAIL", f"{mode} run failed: {first_line(note or (result or {}).get('detail', ''))}", []
            medians[mode] = result["median_us"]
        ratios.append(medians["backend"] / medians["pluggable"])
        info.append(f"round {r}: backend {medians['backend']:.0f} us, pluggable {medians['pluggable']:.0f} us, "
                    f"ratio {ratios[-1]:.3f}")
    ratios.sort()
    median = ratios[len(ratios) // 2]
    return "INFO", f"backend / pluggable step time: median {median:.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} paired rounds)", info


def main():
    global VERBOSE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checks", nargs="*", help="checks to run (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every child's output")
    parser.add_argument("--list", action="store_true", help="list the checks")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--alloc", default="ccalloc", help=argparse.SUPPRESS)
    parser.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        args = dict(a.split("=", 1) for a in opts.arg)
        return child_main(opts.child, opts.alloc, args)
    VERBOSE = opts.verbose

    device_count = None
    checks = [
        ("train_equal", check_train_equal),
        ("allocated_matches_storages", check_allocated),
        ("record_stream", check_record_stream),
        ("cuda_graph", check_cuda_graph),
        ("cudnn_benchmark", check_cudnn_benchmark),
        ("oom_raises", check_oom),
        ("error_raises", lambda: from_child("error_raises")),
        ("ddp_two_gpus", lambda: check_ddp(device_count)),
        ("backend_mode", check_backend_mode),
        ("torch_stats", check_torch_stats),
        ("resnet_cudnn", check_resnet_cudnn),
        ("snapshot", check_snapshot),
        ("snapshot_no_torch", check_snapshot_no_torch),
        ("log", check_log),
        ("compile_reduce_overhead", check_compile),
        ("mempool", check_mempool),
        ("backend_vs_pluggable_time", check_backend_time),
        ("managed_tensor", lambda: from_child("managed_tensor", alloc="native")),
        ("threads_own_streams", lambda: from_child("threads_own_streams")),
    ]
    if opts.list:
        print("\n".join(name for name, _ in checks))
        return 0
    unknown = [c for c in opts.checks if c not in dict(checks)]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; known: {[n for n, _ in checks]}")
    selected = [(n, f) for n, f in checks if not opts.checks or n in opts.checks]

    t_start = time.time()
    env = child_env()
    print(f"INFO repo {REPO}; CCALLOC_LIBRARY={env.get('CCALLOC_LIBRARY', '(unset)')}; "
          f"CCALLOC_CONF={env.get('CCALLOC_CONF', '(unset)')}; python {sys.version.split()[0]}")
    info, note = run_child("info", "ccalloc", timeout=120)
    if info is None or not info.get("ok"):
        print(f"INFO the info child failed under ccalloc: {first_line(note or (info or {}).get('detail', ''))}")
        for line in (note.splitlines()[1:] if note else (info or {}).get("info", [])):
            print(line if line.startswith("    ") else "    " + line)
        native, _ = run_child("info", "native", timeout=120)
        if native is not None and native.get("ok"):
            device_count = native["device_count"]
            print(f"INFO (native) torch {native['torch']}; {device_count} x {native['device']}")
    else:
        device_count = info["device_count"]
        print(f"INFO torch {info['torch']} (CUDA {info['cuda']}, cuDNN {info['cudnn']}); {info['device_count']} x "
              f"{info['device']} ({info['total_memory_gib']} GiB); ccalloc {info.get('ccalloc_version')} "
              f"backend {info.get('ccalloc_backend')} from {info.get('ccalloc_library')}")
        for w in info.get("enable_warnings", []):
            print(f"INFO enable() warned: {w}")

    # INFO: a measurement (a time), reported but not judged: one process's step time moves by
    # 20% from run to run, so a pass/fail on it would be a coin toss.
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0, "INFO": 0}
    for name, fn in selected:
        t0 = time.time()
        try:
            status, detail, lines = fn()
        except Exception as e:  # noqa: BLE001 - a bug in this script: report, go on
            status, detail, lines = "FAIL", f"checker raised {type(e).__name__}: {e}", traceback.format_exc().splitlines()
        counts[status] += 1
        print(f"{status} {name} {detail}", flush=True)
        for line in lines:
            for sub in str(line).splitlines():
                print(sub if sub.startswith("    ") else "    " + sub)
        if status != "SKIP":
            print(f"    ({time.time() - t0:.1f}s)")
        sys.stdout.flush()
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed"
    if counts["SKIP"]:
        summary += f", {counts['SKIP']} skipped"
    if counts["INFO"]:
        summary += f", {counts['INFO']} measured"
    print(f"INFO total {time.time() - t_start:.1f}s")
    print(summary)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
