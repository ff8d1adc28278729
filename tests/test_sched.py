"""thinwire.sched: buckets, WFBP, fusion, MG-WFBP, priority, pipelining, and the trace timeline.

Equality of results across schedules is checked bitwise. On 4 ranks a float sum depends on the order the ring
adds the ranks' values, and that order depends on where bucket boundaries fall; so the 4-rank model is built
to have exactly representable gradients (integer inputs, dyadic weights, float64), where every order gives
the same bits and any mix-up of buckets or ranks still shows.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from thinwire.errors import UserError
from thinwire.optim import step_subset
from thinwire.sched import Buckets, assign, make, merge_plan, priority_order

SCHEDULES = [("none", {}), ("wfbp", {}), ("fusion", {"bucket_mb": 0.0004}),
             ("fusion", {"bucket_mb": 0.0004, "pipeline": True}), ("mgwfbp", {"profile_steps": 2}),
             ("priority", {"chunk_mb": 0.0003, "credit_mb": 0.0006, "profile_steps": 2})]


class Net(nn.Module):
    """Several layers, a parameter never used, and a branch used only on even steps."""

    def __init__(self, exact: bool = False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)
        self.unused = nn.Parameter(torch.zeros(5))
        self.use_extra = True
        if exact:  # dyadic weights with few bits: every gradient and sum below is exact in float64
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randint(-3, 4, p.shape, generator=g).double() / 8)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        out = self.l3(h)
        return out + self.extra(h) if self.use_extra else out


def train_case(rank, world_size, schedule, opts, compressor, exact, steps):
    from thinwire.trainer import Trainer
    torch.manual_seed(0)
    model = Net(exact)
    if exact:
        model = model.double()
    # exact: lr 0 keeps the weights few-bit dyadics, so every step's gradient sums exactly (see the docstring)
    opt = torch.optim.SGD(model.parameters(), lr=0.0 if exact else 0.1, momentum=0.5)
    trainer = Trainer(model, opt, algorithm="bsp", compressor=compressor, schedule=schedule, **opts)
    g = torch.Generator().manual_seed(100 + rank)
    grads = []
    for step in range(steps):
        model.use_extra = step % 2 == 0
        if exact:
            x = torch.randint(-2, 3, (4, 8), generator=g).double()
            loss = (model(x) * torch.tensor([1.0, -2.0, 1.0, 3.0], dtype=torch.float64)).sum() / 4
        else:
            x = torch.randn(6, 8, generator=g)
            loss = model(x).pow(2).mean()
        loss.backward()
        trainer.step()
        sched = trainer.algorithm.scheduler
        if sched.defers_update:   # the averaged gradient waits in the result buffer (forward order)
            sched.flush()
            grads.append(sched.result.clone())
        else:
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.zero_grad(set_to_none=step % 3 == 1)   # both ways of zeroing must keep working
    trainer.close()
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return final, grads, trainer.algorithm.metrics()["schedule"]


def all_schedules(rank, world_size, compressor, exact, steps):
    return {f"{s}{sorted(o.items())}": train_case(rank, world_size, s, o, compressor, exact, steps)
            for s, o in SCHEDULES}


def _check_equal(results):
    for rank_res in results:
        ref_final, ref_grads, _ = rank_res[f"none{[]}"]
        for name, (final, grads, desc) in rank_res.items():
            assert torch.equal(final, ref_final), (name, (final - ref_final).abs().max())
            for a, b in zip(grads, ref_grads):
                assert torch.equal(a, b), name
    for name in results[0]:  # every rank holds the same model
        assert all(torch.equal(r[name][0], results[0][name][0]) for r in results)


def test_schedules_equal_bitwise_2_ranks(pool2):
    res = pool2.run(all_schedules, "none", False, 4)
    _check_equal(res)
    descs = {name: r[2] for name, r in res[0].items()}
    assert descs["wfbp[]"]["buckets"] == 9                      # one exchange per parameter
    assert descs["none[]"]["buckets"] == 1
    assert descs["fusion[('bucket_mb', 0.0004)]"]["buckets"] == 1   # DDP's 1 MB first bucket on lan
    assert descs["priority[('chunk_mb', 0.0003), ('credit_mb', 0.0006), ('profile_steps', 2)]"]["chunks"] > 3
    fp16 = pool2.run(all_schedules, "fp16", False, 3)           # a deterministic compressor, per bucket
    _check_equal(fp16)


def test_schedules_equal_bitwise_4_ranks(pool4):
    res = pool4.run(all_schedules, "none", True, 3)
    _check_equal(res)


def several_buckets(rank, world_size):
    """fusion with several buckets (no special first bucket) vs none, 3 steps; pipelined too."""
    from thinwire.trainer import Trainer
    outs = {}
    for name, opts in [("none", {"schedule": "none"}),
                       ("fusion", {"schedule": "fusion", "bucket_mb": 0.0003, "first_bucket_mb": 0.0}),
                       ("pipe", {"schedule": "fusion", "bucket_mb": 0.0003, "first_bucket_mb": 0.0,
                                 "pipeline": True}),
                       ("serial", {"schedule": "fusion", "bucket_mb": 0.0003, "first_bucket_mb": 0.0,
                                   "serial": True})]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tr = Trainer(model, opt, **opts)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            tr.step()
            opt.zero_grad()
        outs[name] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                      len(tr.algorithm.scheduler.sizes))
        tr.close()
    return outs


def test_several_buckets_and_pipeline(pool2):
    res = pool2.run(several_buckets)
    for r in res:
        assert r["fusion"][1] > 2 and r["pipe"][1] > 2 and r["serial"][1] > 2
        for name in ("fusion", "pipe", "serial"):
            assert torch.equal(r[name][0], r["none"][0]), name


# -- single-process logic ------------------------------------------------------------------------------

def replan_keeps_residuals(rank, world_size, steps):
    """mgwfbp re-plans its buckets after profiling; top-k with error feedback across it (lr 0: fixed model)."""
    from thinwire.trainer import Trainer
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    trainer = Trainer(model, opt, algorithm="bsp", compressor="topk", memory="residual", ratio=0.3,
                      schedule="mgwfbp", profile_steps=2)
    g = torch.Generator().manual_seed(100 + rank)
    local, agg = torch.zeros(sum(p.numel() for p in params)), torch.zeros(sum(p.numel() for p in params))
    for _ in range(steps):
        loss = model(torch.randn(6, 8, generator=g)).pow(2).mean()
        used = [p for p in params if p is not model.unused]
        gs = dict(zip(map(id, used), torch.autograd.grad(loss, used, retain_graph=True)))
        local += torch.cat([gs.get(id(p), torch.zeros_like(p)).reshape(-1) for p in params])
        loss.backward()
        trainer.step()
        agg += torch.cat([p.grad.reshape(-1) for p in params])
        opt.zero_grad()
    sched = trainer.algorithm.scheduler
    residual = torch.zeros_like(local)
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    for key, b in zip(sched.keys, sched.buckets):
        r = trainer.memory.residuals.get(key, torch.zeros(b.buffer.numel()))
        at = 0
        for i in b.members:
            n = params[i].numel()
            residual[offsets[i]:offsets[i] + n] = r[at:at + n]
            at += n
    trainer.close()
    return local, agg, residual, len(sched.keys), len(params)


def test_replan_keeps_error_feedback(pool2):
    """Σ_t aggregate_t + mean_r residual_r = mean_r Σ_t g_r,t across MG-WFBP's change of buckets."""
    out = pool2.run(replan_keeps_residuals, 5)
    local = sum(o[0] for o in out) / 2
    residual = sum(o[2] for o in out) / 2
    assert out[0][3] < out[0][4]            # the plan merged buckets: the keys changed after step 2
    assert torch.allclose(out[0][1] + residual, local, atol=1e-5)


def test_regroup_moves_flat_state_to_new_buckets():
    from thinwire.compress.base import regroup
    old, new = [("a", 3), ("b", 2), ("c", 4)], [("ab", 5), ("c'", 1), ("rest", 3)]
    state = {"residuals": {"a": torch.tensor([1., 2., 3.]), "c": torch.arange(4.), "other": torch.ones(1)},
             "q": {("a", 0): torch.zeros(2, 2)}, "count": 3}
    got = regroup(state, old, new)
    assert torch.equal(got["residuals"]["ab"], torch.tensor([1., 2., 3., 0., 0.]))   # "b" never held a residual
    assert torch.equal(got["residuals"]["c'"], torch.tensor([0.]))
    assert torch.equal(got["residuals"]["rest"], torch.tensor([1., 2., 3.]))
    assert set(got["residuals"]) == {"ab", "c'", "rest", "other"}
    assert got["q"] is state["q"] and got["count"] == 3      # not per-bucket flat state: untouched
    from thinwire.compress import compressors
    p = compressors.get("powersgd")                          # per-matrix Q: follows its matrix's elements
    q1, q2 = torch.ones(3, 1), torch.zeros(2, 1)
    p.q = {("a", 0, 2, 3, 1): q1, ("c", 0, 2, 2, 1): q2}
    p.rekey([("a", 6), ("b", 2), ("c", 4)], [("ab", 8), ("c2", 4)])
    assert p.q == {("ab", 0, 2, 3, 1): q1, ("c2", 0, 2, 2, 1): q2}
    p.rekey([("ab", 8), ("c2", 4)], [("x", 7), ("y", 5)])
    assert set(p.q) == {("x", 0, 2, 3, 1), ("y", 1, 2, 2, 1)}


def test_buckets_cover_every_parameter_once():
    net = Net()
    params = list(net.parameters())
    for cap in (0, 100, 600, 1e9):
        for first in (None, 0, 64):
            groups = assign(params, cap, first)
            assert sorted(i for g in groups for i in g) == list(range(len(params)))
            assert [i for g in groups for i in g] == list(reversed(range(len(params))))   # backward order
    assert len(assign(params, 0)) == len(params)
    assert len(assign(params, 1e9)) == 1
    net.l1.weight.grad = torch.ones_like(net.l1.weight)
    b = Buckets(params, assign(params, 600))
    for i, p in enumerate(params):   # every grad is a view of its bucket, existing values adopted
        assert p.grad is not None and p.grad.data_ptr() == b.view(i).data_ptr()
    assert torch.equal(net.l1.weight.grad, torch.ones_like(net.l1.weight))
    net.unused.grad = None
    b.adopt(params.index(net.unused))
    assert net.unused.grad.abs().sum() == 0 and net.unused.grad.data_ptr() == b.view(params.index(net.unused)).data_ptr()
    with pytest.raises(ValueError):
        Buckets(params, [[0, 1], [1, 2]])


def test_merge_plan_rule():
    sizes = [1000.0] * 5
    ready = [0.0, 1.0, 2.0, 3.0, 4.0]
    # free link, no start-up: nothing is worth merging
    assert merge_plan(ready, sizes, lambda x: 0.0, 0.0) == [1, 1, 1, 1, 1]
    # a start-up much larger than the gaps between layers: everything merges (one collective)
    assert merge_plan(ready, sizes, lambda x: 10.0 + x * 1e-6, 10.0) == [5]
    # a slow link: the first layer goes at once (waiting 1 > α), then the link is busy for 10 s, so every
    # later layer is ready before it could start anyway and merges for free
    assert merge_plan(ready, sizes, lambda x: 0.1 + x * 1e-2, 0.1) == [1, 4]
    # fast transfers, waits longer than α: separate
    assert merge_plan(ready, sizes, lambda x: 0.1 + x * 1e-5, 0.1) == [1, 1, 1, 1, 1]
    assert sum(merge_plan([0.0, 0.0, 5.0, 5.0], [1.0] * 4, lambda x: 0.5, 0.5)) == 4


def test_priority_order_simulation():
    cost = lambda x: 1.0
    assert priority_order([0.0] * 4, [1.0] * 4, cost, credit=1.0) == [0, 1, 2, 3]
    # backward makes the last chunk ready first; the earlier ones overtake once the window is full
    order = priority_order([3.0, 2.0, 1.0, 0.0], [1.0] * 4, cost, credit=1.0)
    assert order[0] == 3 and sorted(order) == [0, 1, 2, 3]
    assert priority_order([3.0, 0.5, 0.5, 0.0], [1.0] * 4, cost, credit=1.0) == [3, 1, 2, 0]


def test_step_subset_matches_full_step():
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for _ in range(2):
        for m in (a, b):
            m(torch.ones(2, 8)).sum().backward()
        oa.step()
        pb = list(b.parameters())
        step_subset(ob, pb[:3])
        step_subset(ob, pb[3:])
        oa.zero_grad(), ob.zero_grad()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert all(len(g["params"]) == len(list(b.parameters())) for g in ob.param_groups)


def test_unknown_schedule_is_a_user_error():
    with pytest.raises(UserError, match="valid: none, wfbp, fusion, mgwfbp, priority"):
        make("fifo")
    with pytest.raises(UserError):
        make("fusion", bucket_mb=-1)


# -- the trace -----------------------------------------------------------------------------------------

def _well_nested(spans, tol=1e-6):
    stack = []
    for s, e in sorted(spans, key=lambda t: (t[0], -t[1])):
        while stack and stack[-1] <= s + tol:
            stack.pop()
        if stack and e > stack[-1] + tol:
            return False
        stack.append(e)
    return True


def test_trace_spans_nest_exactly_as_written(tmp_path):
    """Lanes are decided on the times written: after hours of uptime perf_counter in µs is ~1e10, where
    shifting the origin after nesting rounded ts + dur across a parent's end."""
    import random
    from thinwire.trace import Tracer, write_chrome_trace
    rng, tr = random.Random(0), Tracer(0)
    for _ in range(300):
        s, d = 15000.0 + rng.uniform(0, 1), rng.uniform(0, 0.01)
        tr.complete("parent", s, s + d, "communicate")
        tr.complete("child", s + d * rng.random(), s + d + rng.choice([0, 1e-12, -1e-12, 5e-13]), "communicate")
    write_chrome_trace(str(tmp_path / "t.json"), [tr.events])
    by_thread: dict = {}
    for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]:
        if e.get("ph") == "X":
            by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert sum(len(v) for v in by_thread.values()) == 600
    assert all(_well_nested(v, tol=0.0) for v in by_thread.values())


def test_trace_file(pool2, tmp_path):
    from thinwire.run.train import TrainConfig, run_training
    cfg = TrainConfig(workload="digits-mlp", algorithm="bsp", workers=2, network="custom:latency=2ms",
                      steps=4, trace=True, progress=False,
                      # not serial: each bucket is issued by its gradient hook itself, during backward (a serial
                      # schedule issues from a pipeline thread, which a loaded machine may run after backward)
                      params={"schedule": "wfbp", "serial": False})
    summary = run_training(cfg, out=str(tmp_path), pool=pool2.pool or _start(pool2))
    with open(summary["trace"]) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    procs = {e["pid"] for e in events if e.get("name") == "process_name"}
    assert procs == {0, 1}
    spans = [e for e in events if e.get("ph") == "X"]
    kinds = {e["cat"] for e in spans}
    assert {"forward", "backward", "communicate", "emulated", "optimizer", "compress"} <= kinds
    by_thread: dict = {}
    for e in spans:
        assert e["dur"] >= 0 and math.isfinite(e["ts"])
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert all(_well_nested(v) for v in by_thread.values())
    # per-layer exchanges overlap backward: some communication starts before the backward span ends
    bw = [e for e in spans if e["cat"] == "backward" and e["pid"] == 0]
    comm = [e for e in spans if e["cat"] == "communicate" and e["pid"] == 0]
    assert any(b["ts"] <= c["ts"] < b["ts"] + b["dur"] for b in bw for c in comm)


def _start(pool):
    pool.run(_noop)
    return pool.pool


def _noop(rank, world_size):
    return rank


def test_every_algorithm_exchanges_buckets_during_backward(pool2, tmp_path):
    """dts, cdsgd and localsgd take the scheduler's path: a bucket's exchange starts from its gradient hook,
    before the backward pass that produced it ends (the trace shows it)."""
    from thinwire.run.train import TrainConfig, run_training
    for algorithm, params in [("dts", {"delay": 2, "period": 2}), ("cdsgd", {"warmup": 2, "k": 2}),
                              ("localsgd", {"period": 2})]:
        cfg = TrainConfig(workload="digits-mlp", algorithm=algorithm, workers=2, network="custom:latency=2ms",
                          steps=6, trace=True, progress=False,
                          params={"schedule": "wfbp", "serial": False, "pipeline": False, **params})
        summary = run_training(cfg, out=str(tmp_path / algorithm), pool=pool2.pool or _start(pool2))
        with open(summary["trace"]) as f:
            spans = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
        bw = [e for e in spans if e["cat"] == "backward"]
        comm = [e for e in spans if e["cat"] == "communicate"]
        assert comm, algorithm
        assert any(b["ts"] <= c["ts"] < b["ts"] + b["dur"] for b in bw for c in comm), algorithm


def _clipped(rank, world_size, compressor):
    """bsp over an emulated wan (every bucket still in flight when backward returns, without landing), the loop
    clipping the gradients between backward and step as it would under DDP."""
    from thinwire.trainer import Trainer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, compressor=compressor, bucket_mb=0.002, first_bucket_mb=0.0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        model(torch.randn(6, 8, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        trainer.step()
        opt.zero_grad()
    buckets = len(trainer.algorithm.scheduler.buckets)
    trainer.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), buckets


def test_the_loop_may_clip_the_mean_gradient_between_backward_and_step(pool2):
    """As under DDP, the mean gradient is in every p.grad when backward returns (bsp lands its exchanges at the
    end of backward): clipping it before `trainer.step()` is a replay of clipped mini-batch SGD on the mean. An
    all-reduce still in flight in place would race with the clip, and the workers would drift apart."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    for _ in range(4):
        grads = []
        for g in gens:
            model.zero_grad()
            model(torch.randn(6, 8, generator=g, dtype=torch.float64)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, a, b in zip(model.parameters(), *grads):
            p.grad = a / 2 + b / 2
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for compressor in (None, "fp16"):
        res = pool2.run(_clipped, compressor, network="wan")
        assert res[0][1] > 1                                          # several buckets, each in flight
        assert torch.equal(res[0][0], res[1][0]), compressor
        if compressor is None:
            assert torch.allclose(res[0][0], want, rtol=1e-12, atol=1e-14)


def _clipped_to_zero(rank, world_size, algorithm, params, schedule):
    """The loop clips every gradient to zero between backward and step: (how far the model moved, warnings)."""
    import warnings

    from thinwire.trainer import Trainer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(model, opt, algorithm=algorithm, schedule=schedule, **params)
        for _ in range(6):
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0)
            trainer.step()
            opt.zero_grad()
        trainer.close()
    moved = float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start).abs().max())
    return moved, [str(w.message) for w in seen if "changed gradients" in str(w.message)]


@pytest.mark.parametrize("algorithm,params", [("diloco", {"period": 2, "outer_momentum": 0.0}),
                                              ("localsgd", {"period": 2})])
def test_a_change_after_backward_that_a_sync_step_already_applied_is_named(pool2, algorithm, params):
    """local SGD and DiLoCo take a sync step's local update bucket by bucket in backward: a loop that clips the
    gradients afterwards (here to zero) changes nothing there. Rank 0 is warned once, naming schedule='none',
    under which the clip reaches every step and the model does not move."""
    fused = pool2.run(_clipped_to_zero, algorithm, params, "fusion")
    assert fused[0][0] > 0 and len(fused[0][1]) == 1 and "schedule='none'" in fused[0][1][0] and not fused[1][1]
    plain = pool2.run(_clipped_to_zero, algorithm, params, "none")
    assert [p[0] for p in plain] == [0.0, 0.0] and not plain[0][1]
