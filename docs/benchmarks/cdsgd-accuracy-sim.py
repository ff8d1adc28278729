"""Single-process replica of CD-SGD's eqs. 10–11 (Yu et al. 2021, arXiv 2106.10796) as thinwire/algorithms/cdsgd.py
implements them (ssgd, bitsgd, odsgd, cdsgd; 2-bit threshold quantizer with residual; heavy-ball momentum on W;
optional local momentum step), for multi-seed sweeps on a loaded 2-core machine. Its final accuracies equal those of
real 4-worker runs (`thinwire train ... --json`) bit for bit on every configuration checked
(docs/benchmarks/cdsgd-accuracy.md).

    .venv/bin/python docs/benchmarks/cdsgd-accuracy-sim.py 0,1,2,3 <<< '{"alg":"cdsgd","mom":0.0,"lr":0.5}'

One JSON object per stdin line: run(**obj) for every seed; prints the mean and the per-seed accuracies.
"""
import json
import math
import sys

import torch
from thinwire.run import workloads

torch.set_num_threads(1)


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def setflat(m, v):
    o = 0
    with torch.no_grad():
        for p in m.parameters():
            n = p.numel(); p.copy_(v[o:o + n].view_as(p)); o += n


def run(workload="digits-cnn", alg="cdsgd", world=4, k=5, warmup=10, local_lr=None, alpha=0.5, steps=None,
        seed=0, lr=None, mom=None, local_mom=False, epochs=None, flush=False, kw_diag=None):
    wl = workloads.get(workload)
    lr = wl.lr if lr is None else lr
    mom = wl.momentum if mom is None else mom
    eta_loc = lr if local_lr is None else local_lr
    if steps is None:
        steps = math.ceil((epochs or wl.epochs) * wl.steps_per_epoch(world))
    model = wl.model(seed)
    W = flat(model).clone()
    loaders = [workloads.ShardLoader(*wl.shard(j, world), wl.batch_size, seed=seed, rank=j) for j in range(world)]
    local = alg in ("cdsgd", "odsgd")
    compress = alg in ("cdsgd", "bitsgd")
    if alg == "bitsgd":
        warmup, k = 0, 0
    if alg == "odsgd":
        k = 1
    if alg == "ssgd":
        warmup = 0
    wloc = [W.clone() for _ in range(world)]
    res = [torch.zeros_like(W) for _ in range(world)]
    buf, c = None, 0
    sent_frac = []
    a = alpha
    for i in range(steps):
        formal = i >= warmup if alg != "ssgd" else False
        gs = []
        for j in range(world):
            setflat(model, wloc[j] if (formal and local) else W)
            model.zero_grad()
            xb, yb = loaders[j].next()
            wl.loss(model(xb), yb).backward()
            gs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        q_on = compress and (alg == "bitsgd" or formal) and (k == 0 or c % k != 0)
        if q_on:
            qs = []
            for j in range(world):
                v = gs[j] + res[j]
                q = (v >= a).to(v.dtype) * a - (v <= -a).to(v.dtype) * a
                res[j] = v - q
                qs.append(q)
                sent_frac.append((q != 0).float().mean().item())
                if kw_diag is not None and j == 0 and i % 8 == 0:
                    kw_diag.append(  # (step, |g+e|/|g|, saturated, |e|, |g|)
                        (i, round(v.norm().item() / gs[0].norm().item(), 2), round((v.abs() >= 2 * a).float().mean().item(), 4), round(res[0].norm().item(), 4), round(gs[0].norm().item(), 4)))
            mean = sum(qs) / world
        else:
            mean = sum(gs) / world
            if flush and formal:
                mean = sum(g + r for g, r in zip(gs, res)) / world
                res = [torch.zeros_like(W) for _ in range(world)]
        bprev = buf
        if local_mom and bprev is not None and mom:
            new_loc = [W - lr * mom * bprev - eta_loc * g for g in gs]
        else:
            new_loc = [W - eta_loc * g for g in gs]
        if mom:
            buf = mean.clone() if buf is None else buf.mul_(mom).add_(mean)
            W = W - lr * buf
        else:
            W = W - lr * mean
        if local and (formal or i == warmup - 1):
            wloc = new_loc
        else:
            wloc = [W.clone() for _ in range(world)]
        if formal:
            c += 1
    setflat(model, W)
    acc = wl.evaluate(model)
    return {"acc": round(float(acc), 4), "alpha": a, "sent": (sum(sent_frac) / len(sent_frac)) if sent_frac else None}


if __name__ == "__main__":
    import statistics
    seeds = [int(x) for x in sys.argv[1].split(",")]
    for line in sys.stdin:
        if line.strip():
            kw = json.loads(line)
            accs = [run(seed=s, **kw)["acc"] for s in seeds]
            print(json.dumps({**kw, "mean": round(statistics.mean(accs), 4), "accs": accs}), flush=True)
