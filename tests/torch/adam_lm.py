"""The long-run LM benchmark's small version (bench/adam_lm.py): a byte-level transformer
on the standard library's sources, AdamW, dense Horovod and hvd_dgc with the import
switched trained side by side on every rank (the same initial weights, the same
batches), run under horovodrun by tests/torch/test_adam_lm.py."""

import torch

import horovod.torch as stock
import hvd_dgc.torch as hvd
from harness.stdlib_lm import Batches, byte_lm, loss_of


def side_by_side(variants, steps=400, context=64, batch=16, seed=0):
    """``variants``: label -> hvd_dgc options, each trained beside dense Horovod
    ("horovod"); per label the validation loss every 100 steps, and for hvd_dgc's the
    bytes this rank sent, the Adam phase, and whether the ranks hold the same weights
    (after ``flush()`` where each rank steps on its own between exchanges)."""
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    data = Batches(context, seed, rank, valid_windows=128)
    runs = {}
    for label, options in {"horovod": None, **variants}.items():
        torch.manual_seed(seed)
        model = byte_lm(context, width=64, layers=1, heads=4)
        named = [(f"{label}.{n}", p) for n, p in model.named_parameters()]
        adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        if options is None:
            opt = stock.DistributedOptimizer(adamw, named_parameters=named)
        else:
            opt = hvd.DistributedOptimizer(adamw, named_parameters=named, **options)
        stock.broadcast_parameters(model.state_dict(), root_rank=0)
        runs[label] = (model, opt)
    numel = sum(p.numel() for p in runs["horovod"][0].parameters())

    def validation(model):
        with torch.no_grad():
            return float(loss_of(model, *data.validation()))

    start = validation(runs["horovod"][0])
    curves = {label: [] for label in runs}
    for step in range(steps):
        x, y = data.next(batch)
        for label, (model, opt) in runs.items():
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
            if (step + 1) % 100 == 0:
                curves[label].append(validation(model))
    out = {"start": start, "curves": curves, "numel": numel, "steps": steps}
    for label in variants:
        model, opt = runs[label]
        opt.flush()  # (documented with delay/period; nothing to do after synchronous steps)
        stats = opt.compression_stats()
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = stock.allgather(mine.unsqueeze(0), name=f"adam_lm.{label}")
        out[label] = {"bytes": float(stats["bytes_sent"]), "phase": stats.get("adam_phase"),
                      "identical": all(torch.equal(everyone[0], e) for e in everyone)}
    return out
