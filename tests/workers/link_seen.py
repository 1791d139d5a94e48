"""What both frameworks' link-watch jobs (tests/workers/link_watch.py, keras_link_watch.py)
report of a phase: the numbers the planner holds, the weight's path at the job's density
and the optimizer's statistics (no framework imported here)."""


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
