#!/usr/bin/env python3
"""Builds ccalloc.torch's PyTorch adapter once, untimed, before timed runs (corpus.sh, ab.sh).

The adapter is compiled on first use (~20 s, cached under ~/.cache/ccalloc): in a timed run it
would fall into the run or its timeout. Uses $CCALLOC_LIBRARY and the checkout's python/.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python"))

import ccalloc.torch  # noqa: E402

mode = ccalloc.torch.enable()
import torch  # noqa: E402

torch.zeros(1, device="cuda")
print("[prep] ccalloc", ccalloc.version(), "mode", mode)
