"""hvd_dgc's optimizer inside Horovod elastic (``hvd.elastic.run`` + ``TorchState``).

Rank 0 writes ``flag`` at step ``drop_at``; the host-discovery script then
offers one slot instead of two, Horovod stops rank 1 and resets the survivor
to a world of one, which goes on from the last commit to ``steps``."""

import time

import torch

import hvd_dgc.torch as hvd
from tests.torch.torch_dgc import flat_params, loss_of, mlp, ranks_identical


def _elastic(seed, **dgc_options):
    """Model, hvd_dgc optimizer (SGD momentum) and the TorchState that commits both."""
    hvd.init()
    model = mlp(seed=seed)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), **dgc_options)
    return model, opt, hvd.elastic.TorchState(model=model, optimizer=opt, step=0)


def _step(model, opt, state, tag="el"):
    """One step of the elastic loop (the state counts it); its log entry: the step, the
    world size, the loss and whether every rank holds the same weights after it."""
    opt.zero_grad()
    loss = loss_of(model, state.step, hvd.rank())
    loss.backward()
    opt.step()
    state.step += 1
    return {"step": state.step, "size": hvd.size(), "loss": float(loss),
            "identical": ranks_identical(model, f"{tag}.{state.step}.{hvd.size()}")}


def drop_a_worker(flag, steps=40, drop_at=10, density=0.01):
    """Also the run that loses a whole host (``-H localhost:2,127.0.0.1:2``, then only
    ``localhost:2``): the log says how many hosts and ranks per host each step had."""
    model, opt, state = _elastic(3, density=density, clip_norm=1.0)
    log = []

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            log.append(dict(_step(model, opt, state),
                            dgc_step=opt.compression_stats()["step"],
                            world_size=opt.compression_stats()["world_size"],
                            hosts=hvd.cross_size(), local_size=hvd.local_size()))
            if state.step == drop_at and hvd.rank() == 0:
                open(flag, "w").close()
            if state.step >= drop_at:
                time.sleep(0.2)  # let the driver see the change before training ends
            state.commit()

    train(state)
    return {"log": log, "rank": hvd.rank(), "size": hvd.size(),
            "final": flat_params(model).tolist(), "stats": opt.compression_stats()}


def add_a_worker(flag, steps=30, grow_at=8, density=0.01):
    """The other way: start alone, rank 0 writes ``flag`` at ``grow_at`` and the
    discovery script offers a second slot; the newcomer joins from the last commit.
    A warm-up by step runs across the join: the newcomer must take rank 0's step."""
    model, opt, state = _elastic(4, density=density, warmup=20, warmup_unit="step")
    log = []

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            entry = _step(model, opt, state, "ea")
            link = opt._planner.link  # the default cost model: measured at each sync
            log.append(dict(entry, dgc_step=opt.compression_stats()["step"],
                            link=None if link is None else [link.alpha, link.bandwidth]))
            if state.step == grow_at and hvd.rank() == 0:
                open(flag, "w").close()
            if state.step >= grow_at and hvd.size() == 1:
                time.sleep(0.3)  # let the driver start the second worker
            state.commit()

    train(state)
    return {"log": log, "rank": hvd.rank(), "size": hvd.size()}


def lagging_drop_and_join(flag, steps=30, change_at=10, commit_every=5, grow=False,
                          **dgc_options):
    """A Horovod elastic loop (``state.commit()`` every ``commit_every`` steps, nothing
    else added) with averages in flight between commits (``delay``, or the overlapped
    outer loop): two ranks then one (``grow=False``), or one then two. The commit flushes
    them first (elastic.py), so no commit is refused and every rank commits
    weights it agrees on."""
    model, opt, state = _elastic(5, **dgc_options)
    log = []

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            log.append(dict(_step(model, opt, state), in_flight=opt.in_flight))
            if state.step == change_at and hvd.rank() == 0:
                open(flag, "w").close()
            if state.step >= change_at and hvd.size() == (1 if grow else 2):
                time.sleep(0.3)  # let the driver see the change before training ends
            if state.step % commit_every == 0:
                state.commit()
                log[-1]["committed_identical"] = ranks_identical(
                    model, f"elc.{state.step}.{hvd.size()}")

    train(state)
    opt.flush()
    return {"log": log, "rank": hvd.rank(), "size": hvd.size(),
            "final": flat_params(model).tolist(), "stats": opt.compression_stats()}


def delayed_drop(flag):
    return lagging_drop_and_join(flag, delay=2, density=0.01)


def outer_overlap_join(flag):
    from hvd_dgc import OuterLoop
    return lagging_drop_and_join(flag, change_at=8, commit_every=4, grow=True,
                                 outer=OuterLoop(steps=4, overlap=True))
