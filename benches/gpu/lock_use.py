"""How real PyTorch jobs meet ccalloc's locks: per step, allocations, lock acquisitions, and
of those the ones that waited for another thread (contended) or followed another thread's
(handoffs), from `ccalloc.lock_stats()`.

PyTorch runs a training step's forward on the Python thread and its backward on the
autograd engine's thread for the device, both on the current stream; the Python thread
waits in `backward()` meanwhile. Issue 20's "two threads sharing one stream" names that
pattern; `probe_threads.cpp` times it as turns (`PROBE_PHASES`) and as two threads churning
at once (`PROBE_ONE_STREAM`). This script shows which of the two real jobs do: a training
step that alternates shows a few handoffs and no contention; the control, two Python
threads each running inference on the same stream, shows both.

usage: python benches/gpu/lock_use.py [STEPS]   (ccalloc importable; CCALLOC_LIBRARY set)
"""
import sys
import threading
import time

import torch

import ccalloc
import ccalloc.torch

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def resnet50_train():
    import torchvision

    m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def step():
        x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gpt2_train():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config()
    m = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        x = torch.randint(0, cfg.vocab_size, (8, 512), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def two_threads_infer():
    """The control: two Python threads, each running an MLP's inference on the current
    stream at the same time (the GIL is released inside each CUDA op)."""
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().eval()

    def work():
        with torch.no_grad():
            for _ in range(50):
                x = torch.randn(256, 1024, device="cuda")
                for layer in m:
                    x = torch.relu(layer(x))

    def step():
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return step


JOBS = {"resnet50_train": resnet50_train, "gpt2_train": gpt2_train, "two_threads_infer": two_threads_infer}


def measure(name, make):
    step = make()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ccalloc.reset_accumulated_memory_stats()
    allocs_before = ccalloc.memory_stats()["allocation.all.allocated"]
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    locks = ccalloc.lock_stats()
    allocs = ccalloc.memory_stats()["allocation.all.allocated"] - allocs_before
    per = lambda v: v / STEPS  # noqa: E731
    return {
        "job": name,
        "ms_per_step": 1e3 * seconds / STEPS,
        "allocations": per(allocs),
        "acquisitions": per(locks["acquisitions"]),
        "contended": per(locks["contended"]),
        "blocked": per(locks["blocked"]),
        "wait_us": per(locks["wait_ns"]) / 1e3,
        "handoffs": per(locks["handoffs"]),
        "shards": ccalloc.shard_count(),
    }


def main():
    ccalloc.torch.enable()
    torch.zeros(1, device="cuda")
    rows = [measure(name, make) for name, make in JOBS.items()]
    print(f"\nper step, {STEPS} steps after 3 warm-up steps (ccalloc.lock_stats):")
    head = ("job", "ms", "allocations", "lock acquisitions", "contended", "blocked", "wait µs", "handoffs", "shards")
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        print(
            f"| {r['job']} | {r['ms_per_step']:.1f} | {r['allocations']:.0f} | {r['acquisitions']:.0f} | "
            f"{r['contended']:.1f} | {r['blocked']:.1f} | {r['wait_us']:.1f} | {r['handoffs']:.1f} | {r['shards']} |"
        )


if __name__ == "__main__":
    main()
