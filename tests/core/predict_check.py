"""Bodies of tests/core/test_predict.py: a small model ``python -m hvd_dgc.predict`` is given
as ``module:function``, and the optimizer wrapping it on 2 real ranks with the same link
(the ``CostModel`` the CLI's ``LinkMeasurement`` prices with), reporting the path each
tensor took at each step."""


def small():
    """The model the CLI and the optimizer both see: large weights, a bias above and one
    below ``min_compress_size``."""
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def not_a_model():
    return {"weights": [1, 2, 3]}


def chosen(cases, cost_model, steps):
    """For each case (optimizer, options): the optimizer's cost model, and per step its
    density and each tensor's path (compression_stats' last step)."""
    import torch
    import hvd_dgc.torch as hvd
    from hvd_dgc.plan_words import PlanWords
    hvd.init()
    out = {}
    for name, (optimizer, options) in cases.items():
        model = small()
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) \
            if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       cost_model=hvd.CostModel(**cost_model), **options)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(hvd.rank()))
        seen = []
        for _ in range(steps):
            density = opt.compression_stats()["current_density"]
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            stats = opt.compression_stats()
            tensors = stats["last_step"]["tensors"]
            # a step between a period's exchanges sends nothing (its last step stays)
            exchanged = stats["steps"] > sum(s["exchanged"] for s in seen)
            seen.append({"density": density, "exchanged": exchanged,
                         "paths": {n: t["path"] for n, t in tensors.items()}})
        out[name] = {"model": repr(opt._planner.cost_model), "steps": seen,
                     "compressor": PlanWords(opt._planner).kind_name()}
    return out


def wide_mlp():
    """examples/pytorch_synthetic_benchmark.py's ``--model wide_mlp`` (33.5M parameters),
    the model of bench/results/never_slower.md, for bench/results/predict.md."""
    import torch.nn as nn
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1000))


def small_keras():
    """``small`` as a Keras model (the same tensors' sizes)."""
    import keras
    return keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(1024),
                             keras.layers.Dense(256), keras.layers.Dense(10)])
