"""One rank of a job launched by horovodrun across emulated hosts (tests/product/test_hosts.py).

Writes OUTDIR/rank<R>.json with what the test cannot see from outside: Horovod's
view of the topology, the network namespace and host name the rank runs in,
and the result of an allreduce whose exact value the test knows. A file rather
than stdout, because gloo and mpirun prefix and interleave the ranks' lines.

    python tests/product/hosts_check.py OUTDIR
"""

import json
import os
import socket
import subprocess
import sys

import torch
import horovod.torch as hvd


def main(outdir):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # rank r contributes r+1 everywhere: the sum is size*(size+1)/2 exactly
    total = hvd.allreduce(torch.full((4,), float(rank + 1)), op=hvd.Sum, name="hosts_check")
    netns = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                           text=True).stdout.strip()
    report = {
        "rank": rank, "size": size,
        "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
        "netns_inode": os.stat("/proc/self/ns/net").st_ino,
        "netns": netns,
        "hostname": socket.gethostname(),
        "allreduce": total.tolist(),
        "controller": "mpi" if hvd.mpi_enabled() and not hvd.gloo_enabled() else "gloo",
    }
    hvd.shutdown()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
