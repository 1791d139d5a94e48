"""bench/value_bits.py's worker: digits (scikit-learn's, shipped with it) on N ranks, an
MLP trained with SGD and momentum under Horovod dense and under DGC with each value
width, the same data, seeds and batches for all, in one launch; test accuracy per seed."""

import torch

#: the configurations: Horovod itself, and DGC's records with fp32 or 8-bit values
CONFIGS = {"horovod": None, "dgc_fp32_values": 32, "dgc_8bit_values": 8}


def _data(rank, size):
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:-360], order[-360:]
    mine = train[rank::size]
    return (x[mine], y[mine]), (x[test], y[test])


def digits(seeds=(1, 2, 3, 4, 5), epochs=30, density=0.001, warmup=3, batch=32,
           configs=tuple(CONFIGS)):
    """``{config: {"accuracy": [per seed], "ratio": [per seed]}}``: DGC at ``density``
    after a ``warmup``-epoch warm-up, the cost model's assumed 1 Gbit/s link (so the
    large weights go sparse), lr 0.05, momentum 0.9, batch ``batch`` per rank."""
    import horovod.torch as stock
    import hvd_dgc.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    (x, y), (tx, ty) = _data(rank, size)
    out = {}
    for config in configs:
        bits = CONFIGS[config]
        accs, ratios = [], []
        for seed in seeds:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                        torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                        torch.nn.Linear(256, 10))
            named = [(f"vb.{config}.{seed}.{n}", p) for n, p in model.named_parameters()]
            sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            if bits is None:
                opt = stock.DistributedOptimizer(sgd, named_parameters=named)
            else:
                opt = hvd.DistributedOptimizer(
                    sgd, named_parameters=named, density=density, warmup=warmup,
                    cost_model=hvd.CostModel(), compression=hvd.Compression.dgc(
                        value_bits=bits))
            stock.broadcast_parameters(model.state_dict(), root_rank=0)
            for epoch in range(epochs):
                if bits is not None:
                    opt.set_epoch(epoch)
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(
                    1000 * seed + 10 * epoch + rank))
                for i in range(len(y) // batch):
                    idx = order[i * batch:(i + 1) * batch]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                accs.append(float((model(tx).argmax(1) == ty).float().mean()))
            ratios.append(1.0 if bits is None else opt.compression_stats()["compression_ratio"])
        out[config] = {"accuracy": accs, "ratio": ratios}
    return out
