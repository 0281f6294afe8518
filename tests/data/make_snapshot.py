"""Writes small stand-ins for torch.cuda.memory._dump_snapshot() output (the same dict layout:
segments, device_traces with action/addr/size/stream/time_us/frames), for the replay tests.
Run: python3 tests/data/make_snapshot.py"""
import os
import pickle

MiB = 1 << 20
frames = [{"filename": "train.py", "line": 42, "name": "forward"}]
events = [
    # A block allocated before recording started: only its free is in the trace.
    {"action": "free_requested", "addr": 0x7F0000000000, "size": 3 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0000000000, "size": 3 * MiB, "stream": 0},
    {"action": "segment_alloc", "addr": 0x7F0010000000, "size": 20 * MiB, "stream": 0},
    {"action": "alloc", "addr": 0x7F0010000000, "size": 5 * MiB, "stream": 0},
    {"action": "alloc", "addr": 0x7F0010500000, "size": 4 * MiB, "stream": 0},
    {"action": "segment_alloc", "addr": 0x7F0020000000, "size": 2 * MiB, "stream": 7},
    {"action": "alloc", "addr": 0x7F0020000000, "size": 1000, "stream": 7},
    {"action": "free_requested", "addr": 0x7F0010000000, "size": 5 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0010000000, "size": 5 * MiB, "stream": 0},
    {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    {"action": "alloc", "addr": 0x7F0010000000, "size": 2 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0010000000, "size": 2 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0010500000, "size": 4 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0020000000, "size": 1000, "stream": 7},
    {"action": "segment_free", "addr": 0x7F0020000000, "size": 2 * MiB, "stream": 7},
]
for i, e in enumerate(events):
    e["time_us"] = 1000 + i
    e["frames"] = frames
snapshot = {
    "segments": [{"device": 0, "address": 0x7F0010000000, "total_size": 20 * MiB, "stream": 0,
                  "segment_type": "large", "allocated_size": 0, "active_size": 0, "blocks": []}],
    "device_traces": [events, []],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1},
}
here = os.path.dirname(os.path.abspath(__file__))
for protocol in (2, 4, 5):
    with open(os.path.join(here, f"snapshot_p{protocol}.pickle"), "wb") as f:
        pickle.dump(snapshot, f, protocol=protocol)
