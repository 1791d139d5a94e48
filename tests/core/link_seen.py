"""What both frameworks' link-watch jobs (tests/core/link_watch.py, keras_link_watch.py)
report of a phase: the numbers the planner holds, the weight's path at the job's density
and the optimizer's statistics (no framework imported here), and the watch both run.

The watch is the product's but for two settings that keep a busy 2-core machine's jitter
(two ranks, the link's emulator and the test beside them) from reading as a change before
the drop: ``floor`` 20 ms, not 2 (the drop to 1 Mbit/s moves a step by about 500 ms), and
``backoff`` 1 (a probe that found nothing there delays the next by one window, not up to
64: the drop is still read within the job's 6 windows after it)."""

FLOOR, BACKOFF = 0.02, 1
POSTPONED = 3  # windows the drop may wait for a baseline on the fast link (``ready``)


def ready(relinked, done, window):
    """May the test drop the link after ``done`` steps? Not where a probe moved the
    paths (at the agreed steps ``relinked``) in the last two windows: those settle the
    new paths and set the watch's new baseline, and a drop inside them would become the
    baseline (the watch's one blind spot: docs/pytorch.md, "The link, watched"). Every
    rank holds the same ``relinked``, so every rank postpones alike."""
    return all(r + 2 * window <= done for r in relinked)


def seen(planner, weight, density, stats):
    link = planner.link
    return {"alpha": link.alpha, "bandwidth": link.bandwidth,
            "gather_bandwidth": link.gather_bandwidth, "local": list(planner.local),
            "generation": planner.generation, "numel": weight.numel,
            "path": str(planner.path(weight, density)), "stats": stats}


def wait_for_the_change(directory, rank):
    """Rank 0 says it is ready (DIR/ready) and waits for the test to change the link
    (DIR/changed); the other ranks wait in their next collective."""
    import os
    import time
    if rank != 0:
        return
    open(os.path.join(directory, "ready"), "w").close()
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(directory, "changed")):
        if time.time() > deadline:
            raise RuntimeError("the test did not change the link")
        time.sleep(0.05)
