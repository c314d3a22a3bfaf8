"""One rank of the torchrun test (not collected by pytest): gather every node's results on rank 0.

Environment: OUT (directory for rank 0's merged report), FAULT_RANK (the rank that registers a
faulty vendor backend), DIE_RANK (a rank that joins the group and then exits without sending).
"""

import os
import sys
import time

import torch.distributed as dist

import rlx_nb
from rlx_nb.backends.registry import get_backend
from rlx_nb.distributed import gather_report
from rlx_nb.models import demo

rank = int(os.environ["RANK"])
backends = ["cpu-nomkldnn"]
if rank == int(os.environ.get("FAULT_RANK", "-1")):
    # A vendor runtime present on this node only, with a softmax bug.
    rlx_nb.register_backend("vendor-npu", get_backend("fault:softmax-row").fn)
    backends.append("vendor-npu")
if rank == int(os.environ.get("DIE_RANK", "-1")):
    dist.init_process_group("gloo")
    # Die mid-run, not mid-handshake: a rank lost while the others are still connecting fails
    # their init_process_group (gloo's full mesh), which is torch's business, not the gather's.
    time.sleep(3.0)
    os._exit(0)  # gone without a word
model, inputs = demo.transformer()
report = gather_report(model, inputs, backends=backends, timeout_s=60)
if rank == 0:
    path = report.save(os.path.join(os.environ["OUT"], "merged.rlxnb"))
    print("\n".join(report.lines()))
    sys.stdout.flush()
