"""MNIST with Horovod, in the shape of Horovod's examples/pytorch/pytorch_mnist.py,
with Deep Gradient Compression one flag (one line) away.

    horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py           # Horovod
    horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py --dgc     # hvd_dgc
    ... --dgc --density 0.001 --warmup-epochs 4 --delay 4 --period 4 --stats   # all knobs

With --dgc and no --density / --warmup-epochs the script passes no DGC option at all,
as a Horovod script with only its import line switched: hvd_dgc's defaults apply.

Data: torchvision's MNIST when torchvision is installed and the data is in
--data-dir or downloadable; otherwise scikit-learn's digits (8x8, shipped with
the package), and the script says so.
"""

import argparse
import importlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch MNIST (Horovod / hvd_dgc)")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                    help="SGD with momentum (as Horovod's example) or AdamW (--lr 0.001 suits it)")
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--no-cuda", action="store_true")
parser.add_argument("--fp16-allreduce", action="store_true",
                    help="fp16 compression (Horovod's; with --dgc: fp16 values in sparse records)")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--data-dir", default="./data")
parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after N steps (CI)")
parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
dgc = parser.add_argument_group("hvd_dgc")
dgc.add_argument("--dgc", action="store_true", help="Deep Gradient Compression (hvd_dgc)")
dgc.add_argument("--density", type=float, default=None,
                 help="fraction of each gradient sent (default: hvd_dgc's)")
dgc.add_argument("--warmup-epochs", type=float, default=None,
                 help="paper warm-up 25%%->0.1%% over these epochs")
dgc.add_argument("--min-compress-size", type=int, default=None,
                 help="tensors smaller than this always go dense (default: hvd_dgc's)")
dgc.add_argument("--delay", type=lambda v: v if v == "auto" else int(v), default=0,
                 help="delayed gradient averaging: apply each average D steps later "
                      "(auto: D from the measured compute and exchange times)")
dgc.add_argument("--period", type=int, default=1,
                 help="temporally sparse updates: exchange every P-th step, local steps between")
dgc.add_argument("--stats", action="store_true", help="print compression statistics per epoch")
args = parser.parse_args()

# The one-line switch: hvd_dgc.torch is horovod.torch plus DGC's optimizer and compressors.
hvd = importlib.import_module("hvd_dgc.torch" if args.dgc else "horovod.torch")


def load_data():
    """(train_x, train_y, test_x, test_y, description) as float tensors in [0, 1]."""
    try:
        from torchvision import datasets
        train = datasets.MNIST(args.data_dir, train=True, download=True)
        test = datasets.MNIST(args.data_dir, train=False, download=True)
        prep = lambda d: (d.data.float().div(255).unsqueeze(1), d.targets)  # noqa: E731
        return (*prep(train), *prep(test), "MNIST (torchvision)")
    except Exception as exc:  # no torchvision, or no data and no network
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
        y = torch.tensor(y)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        test, train = perm[:360], perm[360:]
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        return (x[train], y[train], x[test], y[test],
                f"scikit-learn digits 8x8 (shipped with the package) - MNIST unavailable ({why})")


class Net(nn.Module):
    def __init__(self, side):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * (side // 2) ** 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def main():
    hvd.init()
    torch.manual_seed(args.seed)
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(1)

    x, y, xt, yt, source = load_data()
    shard = torch.arange(hvd.rank(), len(y), hvd.size())  # DistributedSampler's split
    x, y = x[shard], y[shard]
    if hvd.rank() == 0:
        print(f"data: {source}; {len(y)} train images per rank, {len(yt)} test, "
              f"{hvd.size()} ranks, {'hvd_dgc DGC' if args.dgc else 'Horovod dense'}", flush=True)

    model = Net(x.shape[-1]).to(device)
    # Scale the learning rate by the number of workers, as Horovod's example does.
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                    momentum=args.momentum)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * hvd.size())
    # Horovod's line, unchanged: under hvd_dgc (--dgc) Compression.none / fp16 mean DGC
    # with fp32 / fp16 values; without --dgc this is Horovod itself, dense.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    options = {}
    if args.dgc:  # only what the command line gave: the rest is hvd_dgc's defaults
        given = dict(density=args.density, warmup=args.warmup_epochs, delay=args.delay or None,
                     period=args.period if args.period != 1 else None,
                     min_compress_size=args.min_compress_size)
        options = {key: value for key, value in given.items() if value is not None}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        gradient_predivide_factor=args.gradient_predivide_factor, **options)

    steps = len(y) // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    for epoch in range(1, args.epochs + 1):
        if args.dgc and args.warmup_epochs is not None:
            optimizer.set_epoch(epoch - 1)  # drives an epoch-based warm-up
        model.train()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batches = range(steps)
        if hvd.rank() == 0 and not args.no_progress:
            from tqdm import tqdm
            batches = tqdm(batches, desc=f"epoch {epoch}", leave=False)
        start = time.perf_counter()
        for i in batches:
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
            loss.backward()
            optimizer.step()
        if args.dgc and (args.delay or args.period > 1):
            optimizer.flush()  # apply the averages still in flight: ranks identical again
        elapsed = time.perf_counter() - start

        model.eval()
        with torch.no_grad():
            correct = sum(int((model(xt[j:j + args.test_batch_size].to(device)).argmax(1)
                               == yt[j:j + args.test_batch_size].to(device)).sum())
                          for j in range(0, len(yt), args.test_batch_size))
        accuracy = hvd.allreduce(torch.tensor(correct / len(yt)), name="accuracy")
        if hvd.rank() == 0:
            rate = steps * args.batch_size * hvd.size() / elapsed
            line = (f"epoch {epoch:3d}  loss {loss.item():.4f}  test accuracy "
                    f"{float(accuracy):.4f}  {rate:,.0f} samples/s ({hvd.size()} ranks)")
            if args.dgc:
                s = optimizer.compression_stats()
                last = s["last_step"]
                line += f"  density {last['density']:.4f}"
                if args.stats:
                    line += (f"  last step sent {last['bytes_sent']:,} B of "
                             f"{last['dense_fp32_bytes']:,} B ({last['compression_ratio']:.0f}x)"
                             f"  tensors per path so far {s['paths']}")
            print(line, flush=True)
    if hvd.rank() == 0 and args.dgc:
        s = optimizer.compression_stats()
        print(f"whole run: sent {s['bytes_sent']:,} B of {s['dense_fp32_bytes']:,} B dense fp32 "
              f"({s['compression_ratio']:.1f}x), mean density {s['density']:.4f}", flush=True)
    elif hvd.rank() == 0:  # Horovod's allreduce moves every gradient, fp32 (fp16 halves it)
        width = 2 if args.fp16_allreduce else 4
        sent = sum(p.numel() for p in model.parameters()) * width * steps * args.epochs
        print(f"whole run: sent {sent:,} B (Horovod dense allreduce, 1.0x)", flush=True)


if __name__ == "__main__":
    main()
