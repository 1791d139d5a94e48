"""A model zoo for decisions (``python bench/zoo.py``; the pairs, runs and page live
here so the smoke test can reach them): hvd_dgc's defaults and every setting its docs and
horovodrun_configs/ recommend, each against Horovod's own result at equal steps, on
six (model, recipe) pairs the project was not tuned on.

    python bench/zoo.py                              # every pair, setting and seed
    python bench/zoo.py --pairs gpt_lm --settings horovod default --seeds 0
    python bench/zoo.py --report                     # the page and plot from the CSV

Every run is 2 ranks under ``horovodrun --gloo``, the link assumed slow
(``HVD_DGC_COST_MODEL=assumed``: over loopback the measured link would rightly send
these small models dense, and the point is what compression costs). Each pair trains
the same model from the same seed on the same batches in every setting, each rank on
its own shard; the script is the user's, changed by the one line (and, for the
recommended settings, the options the docs give). The gap is against Horovod at the
same seed (loss: per cent, + = worse; accuracy: points, + = worse); bytes are what a
rank sent (``compression_stats()``; Horovod: 4 bytes per element per step).

Data: the standard library's sources (read at run time; nothing downloaded),
scikit-learn's digits, and for the recommender labelled synthetic clicks.
"""

import argparse
import csv
import math
import os
import statistics
import sys
from typing import Callable, NamedTuple, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hvd_dgc.outer import OuterLoop  # noqa: E402

RUNS = os.path.join(REPO, "bench", "results", "zoo_runs.csv")
LINK_RUNS = os.path.join(REPO, "bench", "results", "zoo_link.csv")
PAGE = os.path.join(REPO, "bench", "results", "zoo.md")

#: setting -> hvd_dgc options (None: stock Horovod). Where each comes from is its name:
#: "default" is the one-line switch; "1gbe"/"25gbe"/"wan" the options
#: horovodrun_configs/<config>.yaml and docs/slow-networks.md give with that config
#: (warm-up in epochs, so the script calls set_epoch as the docs say); "outer" the outer
#: loop as the docs recommend it; the rest are alternatives the zoo weighs against them.
SETTINGS = {
    "horovod": None,
    "default": {},
    "1gbe: warmup=4 epochs": {"density": 0.001, "warmup": 4},
    "25gbe: warmup=1 epoch": {"density": 0.001, "warmup": 1},
    "wan: delay=auto": {"density": 0.001, "warmup": 4, "delay": "auto"},
    "wan: period=4, delay=4": {"density": 0.001, "warmup": 4, "period": 4, "delay": 4},
    "wan: period=8, delay=8": {"density": 0.001, "warmup": 4, "period": 8, "delay": 8},
    "outer H=128, overlap, averaged": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=32, Nesterov (OuterLoop())": {"outer": OuterLoop()},
}

#: what the docs may say instead where a recommended setting fails a recipe (run with
#: --settings): DiLoCo's outer step with its exchange hidden behind the next round; the
#: script's own clipping moved into hvd_dgc's ``clip_norm=`` under delay (the script
#: then no longer clips)
ALTERNATIVES = {
    "outer H=32, Nesterov, overlap": {"outer": OuterLoop(overlap=True)},
    "outer H=32, averaged": {
        "outer": OuterLoop(steps=32, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=32, averaged, overlap": {
        "outer": OuterLoop(steps=32, overlap=True, lr=1.0, momentum=0.0, nesterov=False)},
    "wan: period=4, delay=4, clip_norm=1": {"density": 0.001, "warmup": 4, "period": 4,
                                            "delay": 4, "clip_norm": 1.0},
    "wan: delay=auto, clip_norm=1": {"density": 0.001, "warmup": 4, "delay": "auto",
                                     "clip_norm": 1.0},
}
SETTINGS.update(ALTERNATIVES)


class Task(NamedTuple):
    """One (model, recipe) pair as a user's script holds it."""
    model: object
    optimizer: object
    lr_factor: Callable[[int], float]   # the script's schedule: step -> factor on the rate
    batch: Callable[[], tuple]          # this rank's next (inputs, targets)
    loss: Callable[[object, object, object], object]
    evaluate: Callable[[object], dict]  # {"loss": ..., and "accuracy" where it has one}
    steps_per_epoch: int
    clip: Optional[float] = None        # the script clips the averaged gradient's norm
    metric: str = "loss"                # what the gap is taken on


#: the byte models' context (bytes a sample)
CONTEXT = 48


# --- data -----------------------------------------------------------------------------

def _digits(seed, rank):
    """scikit-learn's digits (ships with the package): 80% train (each rank draws its
    own batches), 20% test, the same split for every seed."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(12345).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.long)
    cut = int(0.8 * len(x))
    gen = np.random.default_rng(seed * 1000 + rank)
    return x[:cut], y[:cut], x[cut:], y[cut:], gen


def _classifier_eval(inputs, targets):
    import torch
    import torch.nn.functional as F

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            out = model(inputs)
        model.train()
        return {"loss": float(F.cross_entropy(out, targets)),
                "accuracy": float((out.argmax(1) == targets).float().mean())}
    return evaluate


def _bytes(seed, rank, context):
    from harness.stdlib_lm import Batches
    return Batches(context, seed, rank, limit=3_000_000)


# --- the pairs ------------------------------------------------------------------------

def gpt_lm(seed, rank, steps):
    """GPT-style byte LM on the stdlib's sources: causal transformer, AdamW betas
    (0.9, 0.95), weight decay 0.1, linear warm-up (5%) then cosine to 10%."""
    import torch
    from harness.stdlib_lm import byte_lm, loss_of, lr_factor
    data = _bytes(seed, rank, CONTEXT)
    model = byte_lm(context=CONTEXT, width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(loss_of(m, *data.validation()))}
    return Task(model, opt, lambda s: lr_factor(s, steps), lambda: data.next(16), loss_of,
                evaluate, steps_per_epoch=len(data.train) // (2 * 16 * CONTEXT))


def bert_encoder(seed, rank, steps):
    """BERT-style masked-byte encoder on the stdlib's sources: bidirectional
    transformer, 15% of bytes masked, AdamW betas (0.9, 0.999), weight decay 0.01,
    linear warm-up (10%) then linear decay to 0."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    data = _bytes(seed, rank, CONTEXT)
    mask_id, width = 256, 64

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(257, width)
            self.pos = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(width, 256)

        def forward(self, x):
            return self.head(self.body(self.embed(x) + self.pos[:x.shape[1]]))

    gen = np.random.default_rng(seed * 1000 + rank + 7)

    def masked(x, rng):
        chosen = torch.from_numpy(rng.random(x.shape) < 0.15)
        return x.masked_fill(chosen, mask_id), x.masked_fill(~chosen, -100)

    def batch():
        x, _ = data.next(16)
        return masked(x, gen)

    def loss(m, x, y):
        return F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1), ignore_index=-100)

    vx, vy = masked(data.validation()[0], np.random.default_rng(54321))

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(loss(m, vx, vy))}

    warm = max(1, steps // 10)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01)
    return Task(model, opt,
                lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / (steps - warm)),
                batch, loss, evaluate, steps_per_epoch=len(data.train) // (2 * 16 * CONTEXT))


def resnet_cnn(seed, rank, steps):
    """ResNet-style CNN (residual blocks, batch norm) on digits: SGD, momentum 0.9,
    Nesterov, weight decay 5e-4, the rate divided by 10 at 50% and 75% of the run."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    xtr, ytr, xte, yte, gen = _digits(seed, rank)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.a = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn_a = nn.BatchNorm2d(cout)
            self.b = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn_b = nn.BatchNorm2d(cout)
            self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            h = F.relu(self.bn_a(self.a(x)))
            return F.relu(self.bn_b(self.b(h)) + self.skip(x))

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(32), nn.ReLU())
            self.body = nn.Sequential(Block(32, 32, 1), Block(32, 64, 2), Block(64, 64, 1))
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            h = self.body(self.stem(x.view(-1, 1, 8, 8)))
            return self.fc(h.mean((2, 3)))

    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)

    def batch():
        idx = torch.from_numpy(gen.integers(0, len(xtr), size=32))
        return xtr[idx], ytr[idx]
    return Task(model, opt, lambda s: 0.1 ** ((s >= steps // 2) + (s >= 3 * steps // 4)),
                batch, lambda m, x, y: F.cross_entropy(m(x), y), _classifier_eval(xte, yte),
                steps_per_epoch=len(xtr) // (2 * 32), metric="accuracy")


def mlp_adam(seed, rank, steps):
    """MLP on digits with Adam at its usual rate (1e-3), constant."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    xtr, ytr, xte, yte, gen = _digits(seed, rank)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch():
        idx = torch.from_numpy(gen.integers(0, len(xtr), size=32))
        return xtr[idx], ytr[idx]
    return Task(model, opt, lambda s: 1.0, batch, lambda m, x, y: F.cross_entropy(m(x), y),
                _classifier_eval(xte, yte), steps_per_epoch=len(xtr) // (2 * 32),
                metric="accuracy")


def lstm_lm(seed, rank, steps):
    """LSTM byte LM on the stdlib's sources (Zaremba et al.'s recipe, smaller): plain
    SGD at rate 1, the averaged gradient's norm clipped to 1 (Horovod's way:
    ``synchronize()``, clip, ``skip_synchronize()``), the rate halved at 60% and 80%."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    data = _bytes(seed, rank, CONTEXT)

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, 64)
            self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
            self.head = nn.Linear(128, 256)

        def forward(self, x):
            return self.head(self.lstm(self.embed(x))[0])

    def loss(m, x, y):
        return F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(loss(m, *data.validation()))}
    model = LSTMLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return Task(model, opt, lambda s: 0.5 ** ((s >= 3 * steps // 5) + (s >= 4 * steps // 5)),
                lambda: data.next(16), loss, evaluate,
                steps_per_epoch=len(data.train) // (2 * 16 * CONTEXT), clip=1.0)


#: the recommender's categorical features: their cardinalities (many small tables)
CARDINALITIES = [3, 4, 5, 7, 10, 12, 16, 20, 30, 50, 80, 100, 150, 300, 500, 1000, 2000, 5000]


def recommender(seed, rank, steps):
    """DLRM-style click model, many small tensors: 18 embedding tables (3 to 5,000 rows,
    8 wide), a bottom MLP for 8 dense features, a top MLP; Adagrad at 0.05. Data:
    SYNTHETIC clicks drawn from a fixed random teacher (the same for every seed)."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    teacher = np.random.default_rng(2024)
    weights = [teacher.normal(0, 1.0, c) for c in CARDINALITIES]
    dense_w = teacher.normal(0, 0.5, 8)
    pair_w = teacher.normal(0, 0.7, (len(CARDINALITIES), 3))  # category x dense interactions
    popular = [teacher.dirichlet(np.full(c, 0.3)) for c in CARDINALITIES]

    def draw(gen, n):
        cats = np.stack([gen.choice(c, size=n, p=p) for c, p in zip(CARDINALITIES, popular)], 1)
        dense = gen.normal(0, 1, (n, 8))
        logit = sum(w[cats[:, i]] for i, w in enumerate(weights)) / 3.0 + dense @ dense_w
        logit += sum(np.tanh(weights[i][cats[:, i]]) * dense[:, j] * pair_w[i, j]
                     for i in range(len(CARDINALITIES)) for j in range(3)) / 3.0
        clicks = (gen.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return (torch.from_numpy(cats), torch.tensor(dense, dtype=torch.float32)), \
            torch.from_numpy(clicks)

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.Embedding(c, 8) for c in CARDINALITIES)
            self.bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
            self.top = nn.Sequential(nn.Linear(8 * (len(CARDINALITIES) + 1), 64), nn.ReLU(),
                                     nn.Linear(64, 1))

        def forward(self, x):
            cats, dense = x
            parts = [t(cats[:, i]) for i, t in enumerate(self.tables)]
            return self.top(torch.cat(parts + [self.bottom(dense)], 1)).squeeze(1)

    gen = np.random.default_rng(seed * 1000 + rank)
    vx, vy = draw(np.random.default_rng(777), 8192)

    def loss(m, x, y):
        return F.binary_cross_entropy_with_logits(m(x), y)

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(loss(m, vx, vy))}
    model = DLRM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    return Task(model, opt, lambda s: 1.0, lambda: draw(gen, 64), loss, evaluate,
                steps_per_epoch=100_000 // (2 * 64))


#: pair -> (builder, steps of a run)
PAIRS = {
    "gpt_lm": (gpt_lm, 800),
    "bert_encoder": (bert_encoder, 800),
    "resnet_cnn": (resnet_cnn, 500),
    "mlp_adam": (mlp_adam, 500),
    "lstm_lm": (lstm_lm, 800),
    "recommender": (recommender, 600),
}


def worker(pair, setting, seed, steps=None, timed_from=None):
    """One run on this rank: the pair's script under Horovod, or switched by one line
    with ``SETTINGS[setting]``. Returns the final evaluation, bytes and time; with
    ``timed_from``, the samples/s of both ranks together from that step to the end."""
    import time
    import torch
    import horovod.torch as stock

    torch.set_num_threads(1)
    options = SETTINGS[setting]
    if options is None:
        hvd = stock
    else:
        import hvd_dgc.torch as hvd
    hvd.init()
    build, default_steps = PAIRS[pair]
    steps = steps or default_steps
    torch.manual_seed(seed)
    task = build(seed, hvd.rank(), steps)
    model, numel = task.model, sum(p.numel() for p in task.model.parameters())
    try:
        opt = hvd.DistributedOptimizer(task.optimizer,
                                       named_parameters=model.named_parameters(),
                                       **(options or {}))
    except ValueError as refusal:  # a setting this recipe cannot take: said, not trained
        return {"pair": pair, "setting": setting, "seed": seed, "steps": steps,
                "metric": task.metric, "refused": str(refusal).split(":")[0]}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, task.lr_factor)
    start = time.perf_counter()
    for step in range(steps):
        if step % task.steps_per_epoch == 0 and hasattr(opt, "set_epoch"):
            opt.set_epoch(step // task.steps_per_epoch)  # as the docs say, for warmup=N epochs
        x, y = task.batch()
        opt.zero_grad()
        task.loss(model, x, y).backward()
        if task.clip is None or "clip_norm" in (options or {}):
            opt.step()
        else:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            with opt.skip_synchronize():
                opt.step()
        schedule.step()
        if step + 1 == timed_from:
            timed = time.perf_counter()
    if hasattr(opt, "flush"):
        opt.flush()  # delay, period, the outer loop: the weights every rank agrees on
    seconds = time.perf_counter() - start
    rate = None if timed_from is None else \
        (steps - timed_from) * len(y) * hvd.size() / (start + seconds - timed)
    sent = 4.0 * numel * steps if options is None else \
        float(opt.compression_stats()["bytes_sent"])
    return {"pair": pair, "setting": setting, "seed": seed, "steps": steps,
            "metric": task.metric, **task.evaluate(model), "bytes": sent,
            "dense_bytes": 4.0 * numel * steps, "numel": numel, "seconds": seconds,
            "samples_per_s": rate, "rank": hvd.rank()}


FIELDS = ["pair", "setting", "seed", "steps", "metric", "loss", "accuracy", "bytes",
          "dense_bytes", "numel", "seconds", "refused"]


def record(path, result, fields=FIELDS):
    """Append ``result``'s ``fields`` to the CSV at ``path`` (its header first)."""
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        out = csv.DictWriter(f, fields)
        if new:
            out.writeheader()
        out.writerow({k: result.get(k, "") for k in fields})


def load(path):
    """The latest run of each (pair, setting, seed)."""
    runs = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            runs[row["pair"], row["setting"], int(row["seed"])] = row
    return runs


def gaps(runs):
    """(pair, setting) -> {"gap": [per seed], "ratio": bytes vs Horovod, "unit": ...}.
    The gap is paired by seed: loss in per cent of Horovod's, accuracy in points;
    + = worse than Horovod."""
    table = {}
    for (pair, setting, seed), row in runs.items():
        ref = runs.get((pair, "horovod", seed))
        if ref is None or setting == "horovod":
            continue
        if row.get("refused"):
            table[pair, setting] = {"refused": row["refused"]}
            continue
        if row["metric"] == "accuracy":
            gap, unit = 100 * (float(ref["accuracy"]) - float(row["accuracy"])), "points"
        else:
            gap, unit = 100 * (float(row["loss"]) / float(ref["loss"]) - 1), "%"
        if not math.isfinite(float(row["loss"])):
            gap = math.inf  # diverged: the weights went non-finite
        cell = table.setdefault((pair, setting), {"gap": [], "ratio": [], "unit": unit})
        cell["gap"].append(gap)
        cell["ratio"].append(float(row["dense_bytes"]) / float(row["bytes"]))
    return table


def shown(gap):
    """A gap as the page prints it (+ = worse); a run that diverged says so."""
    return "diverged" if gap == math.inf else f"{gap:+.2f}"


def summary(table, settings):
    """setting -> (median gap over pairs, worst pair and its gap, pairs within target,
    median bytes ratio, least bytes ratio); each pair's gap is its mean over seeds."""
    out = {}
    for setting in settings:
        cells = {p: c for (p, s), c in table.items() if s == setting and "refused" not in c}
        if not cells:
            continue
        means = {p: statistics.mean(c["gap"]) for p, c in cells.items()}
        ratios = {p: statistics.mean(c["ratio"]) for p, c in cells.items()}
        worst = max(means, key=means.get)
        target = 3.0 if setting.startswith(("wan", "outer")) else 1.0
        held = sum(1 for p, g in means.items()  # (to the page's rounding)
                   if round(g, 6) <= (target / 2 if cells[p]["unit"] == "points" else target))
        out[setting] = (statistics.median(means.values()), worst, means[worst], held,
                        len(means), statistics.median(ratios.values()), min(ratios.values()))
    return out


def report(path, out=None, link_runs=None):
    runs = load(path)
    table = gaps(runs)
    pairs = [p for p in PAIRS if any(k[0] == p for k in table)]
    settings = [s for s in SETTINGS if any(k[1] == s for k in table)]
    seeds = sorted({k[2] for k in runs})
    lines = [
        "# The model zoo: defaults and recommended settings against Horovod",
        "",
        f"`python bench/zoo.py` (2 ranks, `horovodrun --gloo`, the link assumed slow so "
        f"hvd_dgc compresses; seeds {', '.join(map(str, seeds))}; runs in "
        f"[zoo_runs.csv](zoo_runs.csv)). Gap against Horovod at equal steps, paired by seed, "
        f"mean over seeds: loss in % of Horovod's, accuracy in points; **+ = worse than "
        f"Horovod**. In brackets: bytes a rank sent, Horovod's over hvd_dgc's. Targets: "
        f"defaults and the datacenter and 1 GbE settings within 1% (0.5 point), the WAN "
        f"settings and the outer loop within 3% (1.5 points); \"refused\": hvd_dgc "
        f"refuses the setting for this optimizer at wrap time, with the reason.",
        "",
        "| setting | " + " | ".join(pairs) + " | median | worst | within target |",
        "|---|" + "---|" * (len(pairs) + 3),
    ]
    stats = summary(table, settings)
    for setting in settings:
        cells = []
        for pair in pairs:
            c = table.get((pair, setting))
            if c is None:
                cells.append("")
                continue
            if "refused" in c:
                cells.append("refused")
                continue
            ratio = f"({statistics.mean(c['ratio']):.0f}x)"
            diverged = sum(g == math.inf for g in c["gap"])
            if diverged:
                cells.append(f"diverged in {diverged} of {len(c['gap'])} seeds {ratio}")
                continue
            g = statistics.mean(c["gap"])
            spread = f" ±{statistics.pstdev(c['gap']):.1f}" if len(c["gap"]) > 1 else ""
            cells.append(f"{g:+.2f}{spread} {'pt' if c['unit'] == 'points' else '%'} {ratio}")
        if setting not in stats:
            lines.append(f"| {setting} | " + " | ".join(cells) + " | | | |")
            continue
        median, worst, worst_gap, held, n, ratio_median, ratio_least = stats[setting]
        lines.append(f"| {setting} | " + " | ".join(cells) +
                     f" | {shown(median)} ({ratio_median:.0f}x) | {shown(worst_gap)} {worst} | "
                     f"{held} of {n} |")
    lines += ["", "Horovod's own result, mean over seeds:", "",
              "| pair | steps | metric | Horovod | parameters |", "|---|---|---|---|---|"]
    for pair in pairs:
        rows = [r for (p, s, _), r in runs.items() if p == pair and s == "horovod"]
        metric = rows[0]["metric"]
        value = statistics.mean(float(r[metric]) for r in rows)
        lines.append(f"| {pair} | {rows[0]['steps']} | {metric} | {value:.4f} | "
                     f"{int(rows[0]['numel']):,} |")
    text = "\n".join(lines) + "\n"
    if link_runs and os.path.exists(link_runs):
        text += link_table(link_runs)
    if out:
        with open(out, "w") as f:
            f.write(text)
        plot(table, pairs, settings, os.path.splitext(out)[0] + ".png")
    return text


#: the plot's right edge, gap units: larger gaps (and divergence) are drawn there as crosses
PLOT_LIMIT = 12.0


def plot(table, pairs, settings, path):
    """Each setting's gap on every pair (a dot a pair), the targets as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [s for s in settings if s != "horovod"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(shown) + 1.5))
    for i, setting in enumerate(shown):
        for j, pair in enumerate(pairs):
            c = table.get((pair, setting))
            if c is not None and "refused" not in c:
                gap = statistics.mean(c["gap"])  # beyond the axis (or diverged): a cross
                ax.scatter(min(gap, PLOT_LIMIT), i, s=30, color=f"C{j}",
                           marker="o" if gap <= PLOT_LIMIT else "x",
                           label=pair if i == 0 else None)
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(1, color="grey", ls="--", lw=0.8)
    ax.axvline(3, color="grey", ls=":", lw=0.8)
    ax.set_yticks(range(len(shown)), shown)
    ax.invert_yaxis()
    ax.set_xlabel(f"gap against Horovod at equal steps\n(loss %, accuracy points; + = worse; "
                  f"x: beyond {PLOT_LIMIT:g} or diverged)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110, bbox_inches="tight")


LINK_FIELDS = ["pair", "setting", "rate_mbit", "rtt_ms", "steps", "timed_from",
               "samples_per_s", "bytes", "dense_bytes"]


def rank_main(spec):
    """``python bench/zoo.py --rank-run JSON``: what each rank of a run over the emulated
    hosts runs (``worker`` with the link measured, as a user's job would); rank 0 writes
    its result to the JSON's ``out``."""
    import json
    job = json.loads(spec)
    res = worker(job["pair"], job["setting"], 0, job["steps"], job["timed_from"])
    if res["rank"] == 0:
        with open(job["out"], "w") as f:
            json.dump(res, f)


def over_link(pairs, settings, rate_mbit, rtt_ms, steps, timed_from, path):
    """Each (pair, setting) once over two emulated hosts (harness/hosts.py: network
    namespaces joined by the WAN emulator, Horovod's horovodrun over ssh, one rank a
    host), the link measured at wrap time as in a user's job; samples/s from
    ``timed_from`` to ``steps``, appended to ``path``."""
    import json
    import tempfile
    from harness.hosts import EmulatedHosts
    with EmulatedHosts(["h1:1", "h2:1"], rate_mbit=rate_mbit, rtt_ms=rtt_ms) as hosts, \
            tempfile.TemporaryDirectory() as tmp:
        for pair in pairs:
            for setting in settings:
                out = os.path.join(tmp, "result.json")
                spec = json.dumps(dict(pair=pair, setting=setting, steps=steps,
                                       timed_from=timed_from, out=out))
                done = hosts.horovodrun(
                    ["-np", "2", "-H", "h1:1,h2:1", "--gloo", sys.executable,
                     os.path.abspath(__file__), "--rank-run", spec],
                    env={"OMP_NUM_THREADS": "1", "HVD_DGC_COST_MODEL": "",
                         "PYTHONPATH": REPO}, timeout=1800,
                    cwd=REPO)
                if done.returncode != 0 or not os.path.exists(out):
                    raise RuntimeError(f"{pair}, {setting} over the link failed:\n"
                                       f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
                with open(out) as f:
                    res = json.load(f)
                os.remove(out)
                if res.get("refused"):
                    print(f"{pair:13s} {setting:36s} refused", flush=True)
                    continue
                record(path, dict(res, rate_mbit=rate_mbit, rtt_ms=rtt_ms,
                                  timed_from=timed_from), LINK_FIELDS)
                print(f"{pair:13s} {setting:36s} {res['samples_per_s']:.0f} samples/s "
                      f"over {rate_mbit} Mbit/s, RTT {rtt_ms} ms", flush=True)


def link_table(path):
    """Markdown: samples/s over the emulated link against Horovod's, per pair."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    links = sorted({(float(r["rate_mbit"]), float(r["rtt_ms"])) for r in rows})
    lines = []
    for rate, rtt in links:
        here = {(r["pair"], r["setting"]): r for r in rows
                if (float(r["rate_mbit"]), float(r["rtt_ms"])) == (rate, rtt)}
        pairs = [p for p in PAIRS if (p, "horovod") in here]
        settings = [s for s in SETTINGS if any((p, s) in here for p in pairs)]
        first = next(iter(here.values()))
        lines += ["", f"Samples/s over the emulated link ({rate:g} Mbit/s, RTT {rtt:g} ms; "
                  f"2 hosts x 1 rank, horovodrun over ssh, the link measured at wrap time; "
                  f"steps {first['timed_from']} to {first['steps']} of a run, so the "
                  f"warm-up's densities where a setting has one), against Horovod's; "
                  f"Horovod's own in its row:", "",
                  "| setting | " + " | ".join(pairs) + " | median |",
                  "|---|" + "---|" * (len(pairs) + 1)]
        for setting in settings:
            cells, ratios = [], []
            for pair in pairs:
                r, ref = here.get((pair, setting)), here[pair, "horovod"]
                if r is None:
                    cells.append("")
                    continue
                if setting == "horovod":
                    cells.append(f"{float(r['samples_per_s']):.0f}/s")
                    continue
                ratio = float(r["samples_per_s"]) / float(ref["samples_per_s"])
                ratios.append(ratio)
                cells.append(f"{ratio:.2f}x")
            median = f"{statistics.median(ratios):.2f}x" if ratios else ""
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {median} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--settings", nargs="+",
                        default=[s for s in SETTINGS if s not in ALTERNATIVES])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="every pair's steps (default: its own)")
    parser.add_argument("--runs", default=RUNS, help="the CSV each run is appended to")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: the page and plot from the runs recorded")
    parser.add_argument("--out", default=PAGE, help="the results page (the plot beside it)")
    parser.add_argument("--link", type=float, metavar="MBIT",
                        help="instead: samples/s over two emulated hosts at this rate "
                             "(needs root, /dev/net/tun and sshd), seed 0, short runs")
    parser.add_argument("--rtt", type=float, default=0.0, help="with --link: the RTT, ms")
    parser.add_argument("--link-steps", type=int, default=100,
                        help="with --link: each run's steps (timed from step 20)")
    parser.add_argument("--link-runs", default=LINK_RUNS, help="with --link: its CSV")
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        return rank_main(args.rank_run)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; known: {list(SETTINGS)}")
    if args.link:
        over_link(args.pairs, args.settings, args.link, args.rtt, args.link_steps, 20,
                  args.link_runs)
        print(link_table(args.link_runs))
        return None
    if not args.report:
        from harness.hvdrun import run
        for seed in args.seeds:  # a whole seed first: the page can be read after one
            for pair in args.pairs:
                for setting in args.settings:
                    res = run("harness.zoo:worker", np=2, controller="gloo", timeout=3600,
                              env={"HVD_DGC_COST_MODEL": "assumed"},
                              kwargs=dict(pair=pair, setting=setting, seed=seed,
                                          steps=args.steps))[0]
                    record(args.runs, res)
                    if res.get("refused"):
                        print(f"{pair:13s} seed {seed} {setting:36s} refused: "
                              f"{res['refused']}", flush=True)
                        continue
                    print(f"{pair:13s} seed {seed} {setting:36s} loss {res['loss']:.4f}"
                          + (f" accuracy {res['accuracy']:.4f}" if "accuracy" in res else "")
                          + f" {res['dense_bytes'] / res['bytes']:.1f}x {res['seconds']:.0f} s",
                          flush=True)
    print(report(args.runs, args.out, args.link_runs))


if __name__ == "__main__":
    main()
