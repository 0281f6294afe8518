"""Issue 20's "two threads sharing one stream", timed in PyTorch's own form.

A training step runs its forward on the Python thread and, by default, its backward on the
autograd engine's thread for the device, both on the current stream: two threads taking
turns at the allocator. `torch.autograd.set_multithreading_enabled(False)` runs the backward
on the Python thread instead: one thread. This script times the same training steps both
ways, in one process, in interleaved rounds (the order alternates), so that the host's state
and the process's warm-up are shared by both, and prints per round the two-thread step time
over the one-thread step time. Steps are small and many (a deep narrow MLP, batch 32): the
host launches kernels faster than the device runs them only barely, so the allocator's share
of a step (and any cost of the state moving between the two threads' cores at each turn)
shows in the step time.

usage: python benches/gpu/autograd_threads.py ALLOCATOR [ROUNDS] [STEPS]
  ALLOCATOR: native | expandable | ccalloc (ccalloc importable; CCALLOC_LIBRARY set)
Prints one JSON line per round ("AUTOGRAD_THREADS {...}") and a summary line.
"""
import json
import os
import statistics
import sys
import time

ALLOCATOR = sys.argv[1] if len(sys.argv) > 1 else "ccalloc"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 200
WARM_UP = 20

if ALLOCATOR == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

if ALLOCATOR == "ccalloc":
    import ccalloc
    import ccalloc.torch

    ccalloc.torch.enable()


def make_step():
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step, threads: bool) -> float:
    """Seconds per step, `threads`: the backward on autograd's thread (PyTorch's default)."""
    with torch.autograd.set_multithreading_enabled(threads):
        for _ in range(WARM_UP):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / STEPS


def handoffs() -> int:
    """ccalloc's lock handoffs so far (0 under the other allocators)."""
    return ccalloc.lock_stats()["handoffs"] if ALLOCATOR == "ccalloc" else 0


def main():
    step = make_step()
    timed(step, True)  # the process's warm-up, untimed
    ratios = []
    handed = {True: 0, False: 0}
    for r in range(ROUNDS):
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {}
        for mode in order:
            before = handoffs()
            t[mode] = timed(step, mode)
            handed[mode] += handoffs() - before
        ratio = t[True] / t[False]
        ratios.append(ratio)
        rec = {"allocator": ALLOCATOR, "round": r + 1, "two_threads_us": 1e6 * t[True],
               "one_thread_us": 1e6 * t[False], "ratio": ratio}
        print("AUTOGRAD_THREADS " + json.dumps(rec), flush=True)
    steps_each = ROUNDS * (STEPS + WARM_UP)
    hand = {mode: handed[mode] / steps_each if ALLOCATOR == "ccalloc" else float("nan") for mode in handed}
    print(f"{ALLOCATOR}: two threads / one thread, step time: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {ROUNDS} rounds of {STEPS} steps; "
          f"lock handoffs per step: two threads {hand[True]:.1f}, one thread {hand[False]:.1f}")


if __name__ == "__main__":
    main()
