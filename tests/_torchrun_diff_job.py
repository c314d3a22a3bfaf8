"""One rank of the cluster diff test (not collected by pytest): every node's snapshot diffed against node 0's.

Rank 1 runs a catalogue kernel fault in one block's softmax (a node whose runtime is broken), rank 2 ATen's own
kernels instead of oneDNN (a legitimate difference).  Ranks 1 and 2 share one node name (two ranks of one host).
Environment: OUT (the folder for the nodes' snapshots).
"""

import os
import sys

import rlx_nb
from rlx_nb.distributed import gather_diffs
from rlx_nb.models import demo

rank = int(os.environ["RANK"])
if rank > 0:
    os.environ["RLX_NB_NODE"] = "worker"
backend = {1: "fault:softmax-row", 2: "cpu-nomkldnn"}.get(rank, "cpu")
model, inputs = demo.layered(fault_layer=1)
diffs = gather_diffs(model, inputs, backend=backend, directory=os.environ["OUT"], timeout_s=120)
if rank == 0:
    for node, d in diffs.items():
        print(f"== {node}: culprit={d.culprit}" if isinstance(d, rlx_nb.Diff) else f"== {node}: no diff: {d}")
        if isinstance(d, rlx_nb.Diff):
            print("\n".join(d.lines()))
    sys.stdout.flush()
