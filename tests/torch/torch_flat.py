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
    def plain(named):  # Horovod's synthetic benchmark's optimizer: SGD, no momentum
        return torch.optim.SGD([p for _, p in named], lr=0.01)
    out["plain_stock"] = {size: _ops(shapes, lambda named: hvd_stock.DistributedOptimizer(
        plain(named), named_parameters=named)) for size, shapes in (("few", few), ("many", many))}
    out["plain_dense"] = {size: _ops(shapes, lambda named: hvd.DistributedOptimizer(
        plain(named), named_parameters=named, density=1.0))
        for size, shapes in (("few", few), ("many", many))}
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
    from tests.torch.torch_dgc import flat_params, loss_of, wide_mlp
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


def _conv_net(seed, channels_last):
    """A CNN whose 4-D weights are laid out as GPU training scripts lay them out
    (``model.to(memory_format=torch.channels_last)``), or row-major."""
    import torch.nn as nn
    from tests.device import device
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 32, 3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5)).to(device())
    return net.to(memory_format=torch.channels_last) if channels_last else net


def _images(step, rank):
    from tests.device import device
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 3, 10, 10, generator=gen).to(device())
    return x.to(memory_format=torch.channels_last), \
        torch.randint(0, 5, (8,), generator=gen).to(device())


def _conv_step(net, opt, step, rank):
    opt.zero_grad()
    x, y = _images(step, rank)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def channels_last(steps=6):
    """A channels_last model: each weight's flat slices follow its memory order, so its
    gradient comes back with its own strides (torch's fused multi-tensor kernels need
    that); the training is the row-major model's, and checkpoints hold row-major order."""
    import copy
    from tests.torch.torch_dgc import flat_params
    hvd.init()
    rank = hvd.rank()
    out = {}

    def wrap(net, tag, module=hvd, **kw):
        return module.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[(f"cl.{tag}.{n}", p) for n, p in net.named_parameters()], **kw)

    # density 1.0: the same weights as the row-major model's, bit for bit, and Horovod's
    # (with the row-major model: Horovod 0.28.1's allreduce refuses a channels_last
    # gradient, "Tensor is required to be contiguous")
    trails = {}
    for tag, last, module, kw in (("cl", True, hvd, dict(density=1.0)),
                                  ("rm", False, hvd, dict(density=1.0)),
                                  ("stock", False, hvd_stock, {})):
        net = _conv_net(1, last)
        opt = wrap(net, tag, module, **kw)
        trails[tag] = []
        for step in range(steps):
            _conv_step(net, opt, step, rank)
            trails[tag].append(flat_params(net).clone())
        if tag == "cl":
            out["grad_strides"] = [(tuple(p.grad.stride()), tuple(p.stride()))
                                   for p in net.parameters() if p.dim() == 4]
    out["same_as_row_major"] = [bool(torch.equal(a, b))
                                for a, b in zip(trails["cl"], trails["rm"])]
    # AdamW taken over (its first moment seeded into the memory at the freeze, in each
    # weight's memory order): the row-major model's training too
    adam = {}
    for last in (True, False):
        net = _conv_net(3, last)
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(net.parameters(), lr=0.01),
            named_parameters=[(f"cla.{last}.{n}", p) for n, p in net.named_parameters()],
            density=1.0, aggregation="allgather", freeze_variance=2, refresh_variance=2)
        for step in range(steps):
            _conv_step(net, opt, step, rank)
        adam[last] = flat_params(net)
        out["adam_phase"] = opt.compression_stats().get("adam_phase")
        out["adam_refreshes"] = opt.compression_stats().get("adam_refreshes")
    out["adam_same_as_row_major"] = bool(torch.equal(adam[True], adam[False]))
    out["adam_diff"] = float((adam[True] - adam[False]).abs().max())
    # delayed averaging: the late averages handed back in each weight's order, and the
    # flush's average of the weights (Horovod's allreduce takes row-major tensors only)
    delayed = {}
    for last in (True, False):
        net = _conv_net(4, last)
        opt = wrap(net, f"cld{last}", density=0.1, warmup=0, delay=2,
                   min_compress_size=10 ** 6)  # every tensor dense: order-free maths
        for step in range(steps):
            _conv_step(net, opt, step, rank)
        opt.flush()
        delayed[last] = flat_params(net)
    out["delay_same_as_row_major"] = bool(torch.equal(delayed[True], delayed[False]))
    out["delay_diff"] = float((delayed[True] - delayed[False]).abs().max())
    out["vs_horovod"] = max(float((a - b).abs().max())
                            for a, b in zip(trails["cl"], trails["stock"]))

    # DGC: the residual a checkpoint holds is the gradient in row-major order (fp32
    # values: a sent coordinate leaves 0 in the residual, not its 8-bit rounding)
    net = _conv_net(2, True)
    plain = copy.deepcopy(net)
    dgc = dict(density=0.05, warmup=0, compression=hvd.Compression.dgc(value_bits=32))
    opt = wrap(net, "dgc", **dgc)
    _conv_step(net, opt, 0, rank)
    x, y = _images(0, rank)
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    w, g = net[2].weight, plain[2].weight.grad
    v = opt.dgc_memory()["cl.dgc.2.weight"]["v"]
    raw = opt.residual(w).reshape(-1)  # the memory itself, in the weight's memory order

    def matches(a, b):  # where nothing was sent, a is b times one factor (1 / ranks)
        a, b = a.reshape(-1), b.reshape(-1)
        kept = a != 0
        factor = float(a[kept] @ b[kept] / (b[kept] @ b[kept]))
        return bool(torch.allclose(a[kept], factor * b[kept], rtol=1e-4, atol=0)) and \
            int(kept.sum()) > 0.9 * a.numel()
    out["residual_matches"] = matches(v.view(w.shape), g)
    out["raw_read_row_major_matches"] = matches(raw.view(w.shape), g)  # the wrong reading

    # resumed from a checkpoint, bit for bit; loaded by a row-major model, the same memory
    for step in range(1, 3):
        _conv_step(net, opt, step, rank)
    saved = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(net.state_dict())
    memory = opt.dgc_memory()
    for step in range(3, steps):
        _conv_step(net, opt, step, rank)
    resumed = _conv_net(2, True)
    resumed.load_state_dict(weights)
    opt2 = wrap(resumed, "dgc", **dgc)
    opt2.load_state_dict(saved)
    for step in range(3, steps):
        _conv_step(resumed, opt2, step, rank)
    out["resumed_equal"] = bool(torch.equal(flat_params(net), flat_params(resumed)))
    row_major = _conv_net(2, False)
    row_major.load_state_dict(weights)
    opt3 = wrap(row_major, "dgc", **dgc)
    opt3.load_state_dict(saved)
    loaded = opt3.dgc_memory()
    out["portable"] = all(torch.equal(memory[n]["v"], loaded[n]["v"]) for n in memory)
    out["moved"] = float((flat_params(net) - flat_params(_conv_net(2, True))).abs().max())
    return out
