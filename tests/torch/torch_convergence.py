"""Convergence on scikit-learn's digits (ships with the package): 2 ranks, a small CNN,
dense Horovod vs hvd_dgc at 99.9% sparsity with the paper's warm-up."""

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from tests.device import device


def digits(rank, size):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    shard = train[rank::size]
    dev = device()
    return (x[shard].to(dev), y[shard].to(dev)), (x[test].to(dev), y[test].to(dev))


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)).to(device())


def accuracy(model, data):
    x, y = data
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def fit(tag, make_opt, epochs, batch=32, seed=0):
    rank, size = hvd.rank(), hvd.size()
    (x, y), test = digits(rank, size)
    model = cnn(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make_opt(model)
    steps = len(y) // batch
    for epoch in range(epochs):
        if hasattr(opt, "set_epoch"):
            opt.set_epoch(epoch)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch * 7 + rank))
        for i in range(steps):
            idx = order[i * batch:(i + 1) * batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    if hasattr(opt, "flush"):
        opt.flush()  # delayed averaging: apply what is in flight before evaluating
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name=f"conv.check.{tag}")
    same = all(torch.equal(gathered[0], gathered[r]) for r in range(size))
    stats = opt.compression_stats() if hasattr(opt, "compression_stats") else None
    return accuracy(model, test), same, stats


def compare(epochs=30, lr=0.02, delay=4):
    """Dense Horovod vs hvd_dgc: DGC 0.1% (paper warm-up), and delayed averaging
    (``delay``) both dense and with DGC. Same data, model and seed for all four."""
    hvd.init()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)  # noqa
    named = lambda tag, m: [(tag + "." + n, p) for n, p in m.named_parameters()]  # noqa
    runs = {
        "dense": lambda m: hvd_stock.DistributedOptimizer(
            sgd(m), named_parameters=m.named_parameters()),
        "dgc": lambda m: hvd.DistributedOptimizer(
            sgd(m), named_parameters=named("dgc", m), compression=hvd.Compression.dgc,
            density=0.001, warmup=4),
        "dense_delayed": lambda m: hvd.DistributedOptimizer(
            sgd(m), named_parameters=named("dd", m), density=1.0, delay=delay),
        "dgc_delayed": lambda m: hvd.DistributedOptimizer(
            sgd(m), named_parameters=named("gd", m), compression=hvd.Compression.dgc,
            density=0.001, warmup=4, delay=delay),
    }
    out = {}
    for tag, make_opt in runs.items():
        acc, same, stats = fit(tag, make_opt, epochs)
        out[tag] = {"accuracy": acc, "identical": same, "stats": stats}
    return out

