"""Train a small CNN with Horovod + hvd_dgc: the quick demo.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py --epochs 10

The switch from Horovod is the import line below. Data: scikit-learn's digits
(8x8 images, shipped with the package, no download).
"""

import argparse

import torch
import torch.nn as nn
from sklearn.datasets import load_digits

# import horovod.torch as hvd        # <- plain Horovod
import hvd_dgc.torch as hvd          # <- the one-line switch to Deep Gradient Compression


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--density", type=float, default=0.001, help="fraction of each gradient sent")
    ap.add_argument("--warmup-epochs", type=float, default=4)
    ap.add_argument("--dense", action="store_true", help="plain dense averaging, for comparison")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:][hvd.rank()::hvd.size()]
    if hvd.rank() == 0:
        print(f"data: scikit-learn digits (shipped with the package), {len(perm) - 360} train / "
              f"360 test images, {hvd.size()} ranks")

    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if args.dense:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.none)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       density=args.density, warmup=args.warmup_epochs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    steps = len(train) // args.batch_size
    for epoch in range(args.epochs):
        opt.set_epoch(epoch)
        model.train()
        order = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        with torch.no_grad():
            acc = float((model(x[test]).argmax(1) == y[test]).float().mean())
        acc = float(hvd.allreduce(torch.tensor(acc), name="acc"))
        if hvd.rank() == 0:
            s = opt.compression_stats()
            print(f"epoch {epoch + 1:3d}  loss {loss.item():.4f}  test accuracy {acc:.4f}  "
                  f"density {s['last_step']['density']:.4f}  sent {s['last_step']['bytes_sent']:,} B "
                  f"of {s['last_step']['dense_fp32_bytes']:,} B "
                  f"({s['last_step']['compression_ratio']:.0f}x)", flush=True)


if __name__ == "__main__":
    main()
