"""The flat engine's operation counts, under horovodrun: a step's ATen operations (each a
kernel launch on a GPU) for models of more and fewer tensors, stock Horovod and hvd_dgc."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from harness.shapes import resnet50_shapes


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(shapes, make, steps=3):
    """Operations of one step (zero_grad, loss, backward, step) after ``steps`` steps."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    opt = make([(f"t{i}", p) for i, p in enumerate(params)])

    def step():
        opt.zero_grad()
        sum((p * w).sum() for p, w in zip(params, weights)).backward()
        opt.step()
    for _ in range(steps):
        step()
    with _Count() as counter:
        step()
    return counter.count


def counts():
    hvd.init()

    def sgd(named):
        return torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)

    def stock(named):
        return hvd_stock.DistributedOptimizer(sgd(named), named_parameters=named)

    def dgc(**options):
        return lambda named: hvd.DistributedOptimizer(sgd(named), named_parameters=named,
                                                      **options)
    few = [(64, 64)] * 8 + [(64,)] * 8                   # 16 tensors
    many = [(64, 64)] * 40 + [(64,)] * 40                # 80 tensors
    out = {}
    for tag, make in (("stock", stock), ("dgc", dgc(density=0.01, warmup=0)),
                      ("dgc_clip_decay", dgc(density=0.01, warmup=0, clip_norm=1.0)),
                      ("dense", dgc(density=1.0))):
        out[tag] = {"few": _ops(few, make), "many": _ops(many, make)}
    shapes = [s for _, s in resnet50_shapes()]
    out["resnet50"] = {"stock": _ops(shapes, stock, steps=1),
                       "dgc": _ops(shapes, dgc(density=0.001, warmup=0), steps=1)}
    return out


def old_checkpoint(path):
    """Load a checkpoint written before the flat engine (tests/data) and train on."""
    import warnings
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.05,
                                   warmup=0)
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved["optimizer"])
    names = dict(enumerate(n for n, _ in model.named_parameters()))
    old = {names[k]: v for k, v in saved["optimizer"]["hvd_dgc"]["memory"].items()}
    now = opt.dgc_memory()
    same = {n: torch.equal(now[n]["v"], old[n]["v"]) and torch.equal(now[n]["u"], old[n]["u"])
            for n in old}
    before = {n: s["v"].clone() for n, s in now.items()}
    gen = torch.Generator().manual_seed(2)
    opt.zero_grad()
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    after = opt.dgc_memory()
    return {"same": same, "step": opt.compression_stats()["step"],
            "warnings": [str(w.message) for w in caught],
            "moved": max(float((after[n]["v"] - before[n]).abs().max()) for n in after),
            "finite": all(bool(torch.isfinite(s["v"]).all()) for s in after.values()),
            "saved_residual": sum(float(s["v"].abs().sum()) for s in old.values())}


def update_targets(steps=8):
    """The same training, the average written straight into the gradients (GradUpdate)
    and through the launch's flat buffer (FlatUpdate): every step's weights equal."""
    from hvd_dgc.torch import update as update_module
    from tests.workers.torch_dgc import flat_params, loss_of, wide_mlp
    hvd.init()
    rank = hvd.rank()

    def train(force_flat):
        saved = update_module.GradUpdate.fits
        if force_flat:
            update_module.GradUpdate.fits = staticmethod(lambda layout: False)
        try:
            model = wide_mlp(3)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                weight_decay=1e-4),
                named_parameters=model.named_parameters(), density=0.02, warmup=0)
            trail = []
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, step, rank, features=64, classes=10).backward()
                opt.step()
                trail.append(flat_params(model).clone())
            return trail, opt.compression_stats()["paths"]
        finally:
            update_module.GradUpdate.fits = saved
    direct, paths = train(False)
    flat, _ = train(True)
    return {"equal": [bool(torch.equal(a, b)) for a, b in zip(direct, flat)],
            "moved": float((direct[-1] - direct[0]).abs().max()), "paths": paths}
