"""What the ranks' tracked second moment reads against exact Adam's, on the byte LM.

0/1 Adam's refresh (hvd_dgc/adam.py) averages what each rank tracked from its own
gradients since the freeze. Exact Adam (Horovod's) keeps the moving average of the
square of the ranks' *average* gradient. This runs dense AdamW on the average of N
simulated ranks' batches in one process (the weights every rank would hold) and keeps
beside Adam's ``v``, for every parameter, the two rules a rank could track:

- ``own``: each rank's own ``g^2`` (the rule before 2026-12-02), which reads the batches'
  noise N times;
- ``estimate``: ``g^2 / N + (1 - 1/N) g g_previous`` (``observed_weights``, the rule now).

Printed every ``--every`` steps: each rule's sum over the model against exact Adam's,
and the median over the tensors of the step it would give against Adam's (``sqrt(v_exact)
/ sqrt(v_rule)``; above 1: larger steps).

    python bench/adam_variance.py --np 2 --steps 600
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.stdlib_lm import Batches, byte_lm, loss_of, lr_factor  # noqa: E402
from hvd_dgc.adam import observed_weights  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="simulated ranks")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    torch.manual_seed(args.seed)
    model = byte_lm()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
    # bench/adam_lm.py --lr-schedule cosine's schedule over its 3,000 steps
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 3000))
    data = [Batches(128, args.seed, r) for r in range(args.np)]
    beta2 = opt.param_groups[0]["betas"][1]
    square, cross = observed_weights(args.np)
    own = [torch.zeros_like(p) for p in params]
    estimate = [torch.zeros_like(p) for p in params]
    previous = [[torch.zeros_like(p) for p in params] for _ in range(args.np)]
    print(f"dense AdamW on the average of {args.np} ranks' batches (32 x 128 bytes each), "
          f"beta2 {beta2}", flush=True)
    for t in range(1, args.steps + 1):
        grads = []
        for r in range(args.np):
            opt.zero_grad()
            loss_of(model, *data[r].next(32)).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                ranks = [g[i] for g in grads]
                p.grad = sum(ranks) / args.np
                own[i].mul_(beta2).add_(sum(g * g for g in ranks) / args.np, alpha=1 - beta2)
                seen = sum(square * g * g + cross * g * previous[r][i]
                           for r, g in enumerate(ranks)) / args.np
                estimate[i].mul_(beta2).add_(seen, alpha=1 - beta2)
                for r, g in enumerate(ranks):
                    previous[r][i] = g
        opt.step()
        schedule.step()
        if t % args.every == 0:
            exact = [opt.state[p]["exp_avg_sq"] for p in params]
            total = sum(float(v.sum()) for v in exact)
            line = [f"step {t}:"]
            for name, rule in (("own", own), ("estimate", estimate)):
                steps = sorted(float(((v.sqrt() + 1e-8) / (w.clamp(min=0).sqrt() + 1e-8))
                                     .median()) for v, w in zip(exact, rule))
                line.append(f"{name} {sum(float(w.sum()) for w in rule) / total:.3f} of "
                            f"exact Adam's v, steps x{steps[len(steps) // 2]:.3f} "
                            f"({steps[0]:.3f}-{steps[-1]:.3f});")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
