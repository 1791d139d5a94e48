"""tests/core/test_linkwatch.py's job, one rank in each namespace of an emulated link whose
rate the test drops half-way (``python -m tests.core.link_watch DIR``): the PyTorch
optimizer with the default cost model (the link measured) and its link watch.

Rank 0 writes DIR/ready after ``BEFORE`` steps (a window or more later where a probe
had just moved the paths: link_seen.ready) and waits for DIR/changed (the test
changes the link in between; rank 1 waits in the next step's collective); then both
train ``AFTER`` steps more, rank 1 a little later, and end with no collective after the
last step. Prints, last, a JSON line of what each phase measured; writes its weights to
DIR/weights.<rank>."""

import json
import os
import sys
import time

import torch

import hvd_dgc.torch as hvd
from tests.core.link_seen import BACKOFF, FLOOR, POSTPONED, ready, seen, \
    wait_for_the_change

BEFORE, AFTER, WINDOW, DENSITY = 24, 24, 4, 0.0625  # (the job ends at a window's end)


def _seen(opt, weight):
    return seen(opt._planner, weight, DENSITY, opt.compression_stats())


def main(directory):
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 4))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), density=DENSITY,
        link_watch=hvd.LinkWatch(window=WINDOW, floor=FLOOR, backoff=BACKOFF),
        timeline=False)  # (the watch alone: no trial of the timeline's plan moves the paths)
    weight = max(opt._planner.tensors, key=lambda t: t.numel)
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    x, y = torch.randn(64, 128, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    out = {}

    def train(steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    train(BEFORE)
    before = BEFORE
    while before < BEFORE + POSTPONED * WINDOW and \
            not ready(opt.compression_stats()["relinked_at"], before, WINDOW):
        train(WINDOW)
        before += WINDOW
    out["before"] = _seen(opt, weight)
    wait_for_the_change(directory, hvd.rank())
    train(AFTER - 1)
    if hvd.rank() == 1:  # rank 0 ends first, its last window's agreement in flight:
        observe = opt._watcher.observe  # rank 1 is late to launch its own

        def late(*args):
            time.sleep(0.5)
            return observe(*args)
        opt._watcher.observe = late
    train(1)  # (the job ends at a window's end, with no collective after it)
    out["after"] = _seen(opt, weight)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(directory, f"weights.{hvd.rank()}"))
    out.update(before_steps=before, window=WINDOW, density=DENSITY)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
