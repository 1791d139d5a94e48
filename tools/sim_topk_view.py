"""Screening, not evidence: DGC's top-k at 0.1% on Adam with its variance frozen, with
each rank's gradient taken at the shared weights (what hvd_dgc runs) or at the shared
weights minus this rank's own unsent residual (an error-reset view, after CSER: Xie et
al., "CSER: Communication-efficient SGD with Error Reset", NeurIPS 2020).

    python tools/sim_topk_view.py sync 0 1500     # mode, seed, steps
    python tools/sim_topk_view.py view 0 1500

One process, two simulated ranks, no Horovod (a design is tried here before it is built;
the product's numbers come from bench/adam_lm.py over real Horovod). The maths is
hvd_dgc/adam.py's: exact AdamW to step 20 on the ranks' average, the variance frozen and
floored at 1% of its tensor's mean, refreshed at 40, 80, 160, ... from each rank's own
tracking; momentum correction and masking in the preconditioned space; the paper's
warm-up stages over 300 steps from the freeze, then 0.1%; tensors under 1,024 elements
dense. Prints the validation loss of the shared weights and of rank 0's view, and the
bytes a rank sent (4 a value, 4 an index). bench/results/adam_lm_3000.md has what it
showed.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.stdlib_lm import Batches, byte_lm, loss_of  # noqa: E402
from hvd_dgc.adam import DEFAULT_FREEZE, VARIANCE_FLOOR, refreshes_at  # noqa: E402
from hvd_dgc.config import DGCConfig  # noqa: E402
from hvd_dgc.schedule import DensitySchedule, num_selected  # noqa: E402

mode, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
N, lr, wd, b1, b2, eps, T = 2, 2e-3, 0.01, 0.9, 0.999, 1e-8, DEFAULT_FREEZE
SMALL = DGCConfig().min_compress_size  # tensors below it go dense
density = DensitySchedule(0.001, warmup=300, unit="step")  # bench's density=0.001
torch.set_num_threads(1)
datas = [Batches(128, seed, r) for r in range(N)]
torch.manual_seed(seed)
model = byte_lm(128)
params = list(model.parameters())
xbar = [p.detach().clone() for p in params]
m = [torch.zeros_like(p) for p in params]
v = [torch.zeros_like(p) for p in params]
vr = [[torch.zeros_like(p) for p in params] for _ in range(N)]
u = acc = P = None


def floored_P(vhat):
    out = []
    for x in vhat:
        mean = float(x.mean())
        out.append(1.0 / (torch.clamp(x, min=VARIANCE_FLOOR * mean).sqrt() + eps))
    return out


def grads_at(weights, r):
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    model.zero_grad()
    x, y = datas[r].next(32)
    loss_of(model, x, y).backward()
    return [p.grad.detach().clone() for p in params]


def validate(weights):
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
        return float(loss_of(model, *datas[0].validation()))


sent_elems = 0
t0 = time.time()
for t in range(1, steps + 1):
    if t <= T:
        gs = [grads_at(xbar, r) for r in range(N)]
        for i in range(len(params)):
            g = sum(gg[i] for gg in gs) / N
            for r in range(N):
                vr[r][i].mul_(b2).addcmul_(gs[r][i], gs[r][i], value=1 - b2)
            xbar[i].mul_(1 - lr * wd)
            m[i].mul_(b1).add_(g, alpha=1 - b1)
            v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
            xbar[i].addcdiv_(m[i], (v[i] / (1 - b2 ** t)).sqrt() + eps,
                             value=-lr / (1 - b1 ** t))
        sent_elems += N * sum(p.numel() for p in params)
        if t == T:
            P = floored_P([x / (1 - b2 ** t) for x in v])
            u = [[P[i] * m[i] for i in range(len(params))] for _ in range(N)]
            acc = [[torch.zeros_like(p) for p in params] for _ in range(N)]
            vr = [[x.clone() for x in v] for _ in range(N)]
    else:
        c = lr / (1 - b1 ** t)
        if mode == "view":
            gs = [grads_at([xb - c * a for xb, a in zip(xbar, acc[r])], r) for r in range(N)]
        else:
            gs = [grads_at(xbar, r) for r in range(N)]
        d = density(t - T - 1, 0.0)  # steps since the freeze
        for i in range(len(params)):
            n = params[i].numel()
            total = torch.zeros(n)
            for r in range(N):
                g = gs[r][i]
                vr[r][i].mul_(b2).addcmul_(g, g, value=1 - b2)
                u[r][i].mul_(b1).add_(P[i] * g, alpha=1 - b1)
                acc[r][i].add_(u[r][i])
                a = acc[r][i].view(-1)
                if n < SMALL:
                    total += a
                    a.zero_()
                    sent_elems += n
                else:
                    k = num_selected(n, d)
                    idx = a.abs().topk(k).indices
                    total[idx] += a[idx]
                    a[idx] = 0
                    u[r][i].view(-1)[idx] = 0
                    sent_elems += 2 * k
            xbar[i].mul_(1 - lr * wd)
            xbar[i].add_(total.view_as(xbar[i]), alpha=-c / N)
        if refreshes_at(t, T, "auto"):  # 2T, 4T, 8T, ...
            vbar = [sum(vr[r][i] for r in range(N)) / N for i in range(len(params))]
            Pn = floored_P([x / (1 - b2 ** t) for x in vbar])
            for r in range(N):
                vr[r] = [x.clone() for x in vbar]
                for i in range(len(params)):
                    ratio = Pn[i] / P[i]
                    u[r][i].mul_(ratio)
                    acc[r][i].mul_(ratio)
            P = Pn
            sent_elems += N * sum(p.numel() for p in params)
    if t % 250 == 0 or t == steps:
        local = validate([xb - lr / (1 - b1 ** t) * a for xb, a in zip(xbar, acc[0])]) \
            if acc is not None else float("nan")
        print(mode, seed, t, f"shared {validate(xbar):.4f} rank0-view {local:.4f}",
              f"bytes/rank {4 * sent_elems / N / 1e6:.1f} MB", f"{time.time() - t0:.0f}s",
              flush=True)
