"""Elastic jobs (issue 34, items 5 and 7): a worker that joins a running job at its algorithm's next
synchronization boundary, with the model, optimizer and algorithm state of a live peer (DiLoCo's: θ and the outer
optimizer, the inner optimizer afresh); refused and failed joins.

One elastic pool (2 members + 1 process in reserve) serves every test: a newcomer of one run is the reserve of
the next (a run that fails closes the pool: the next test that asks for it gets a new one)."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import thinwire as tw
from thinwire.comm import elastic
from thinwire.run import workloads

TARGET = workloads.get("digits-mlp").target


def _sha(model) -> str:
    return hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()).hexdigest()


def _train(member, workers, algorithm, params, want, after, other=None, cap=3000):
    """Train digits-mlp until the job has `want` members, then `after` more steps (every member stops at the same
    step: they switched at the same boundary). The newcomer (`member` >= `workers`) may run `other` parameters
    (a refused join), die while it takes its state (`other == "die"`) or come with a model far from the job's
    (`other == "poison"`: every parameter 1000)."""
    wl = workloads.get("digits-mlp")
    model = wl.model(0)
    opt = torch.optim.SGD(model.parameters(), lr=wl.lr, momentum=0.9)
    if member >= workers and other == "die":
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        elastic.recv_state = die
    if member >= workers and other == "poison":
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1000.0)
    mine = params if member < workers or other in (None, "die", "poison") else other
    trainer = tw.Trainer(model, opt, algorithm=algorithm, network="custom:latency=1ms", **mine)
    gen, stop, at_join, largest, inner_at_join = None, None, None, None, None
    while trainer.step_count < (cap if stop is None else stop):
        if stop is None and trainer.transport.world_size >= want:
            stop, at_join = trainer.step_count + after, (trainer.step_count, _sha(model))
            inner_at_join = len(opt.state)      # optimizer state entries (the newcomer's: what it took)
            largest = max(p.detach().abs().max().item() for p in model.parameters())
        if stop is None and other == "die" and trainer.failures:    # the newcomer was lost: go on a while
            stop = trainer.step_count + after
        if trainer.elastic.gen != gen:     # the data follows the membership: this generation's shard
            gen, rank, size = trainer.elastic.gen, trainer.transport.rank, trainer.transport.world_size
            loader = workloads.ShardLoader(*wl.shard(rank, size), 32, seed=gen, rank=rank)
        x, y = loader.next()
        wl.loss(model(x), y).backward()
        tw.report_progress(trainer.step_count + 1)
        trainer.step()
        opt.zero_grad()
    trainer.close()
    return {"sha": _sha(model), "at_join": at_join, "steps": trainer.step_count, "accuracy": wl.evaluate(model),
            "joins": trainer.joins, "failures": trainer.metrics().get("failures", []), "gen": trainer.elastic.gen,
            "participants": trainer.metrics().get("participants"), "largest_at_join": largest,
            "inner_at_join": inner_at_join}


@pytest.fixture(scope="module")
def _epools():
    held = {}
    yield held
    if held:
        held["pool"].close()


@pytest.fixture
def epool(_epools):
    from thinwire.launcher.elastic import ElasticPool
    if "pool" not in _epools or _epools["pool"].closed:
        _epools["pool"] = ElasticPool(2, max_workers=3, spares=1, timeout=300)
    return _epools["pool"]


@pytest.mark.parametrize("algorithm,params", [("bsp", {}), ("localsgd", {"period": 4}),
                                              ("diloco", {"period": 4, "outer_lr": 0.6, "outer_momentum": 0.5}),
                                              ("dts", {"delay": 2, "period": 2})])
def test_a_newcomer_joins_at_the_boundary_with_a_peers_state(epool, algorithm, params):
    out = epool.run(_train, algorithm, params, 3, 150, joins=[("time", 0)])
    assert sorted(out) == [0, 1, 2] and not epool.lost and not epool.refused
    gens = epool.generations
    assert [g["kind"] for g in gens] == ["start", "join"] and gens[1]["members"] == [0, 1, 2]
    # at the boundary where it joined, the newcomer holds the members' model, bitwise; so at the end
    assert len({o["at_join"] for o in out.values()}) == 1, algorithm
    assert len({o["sha"] for o in out.values()}) == 1, algorithm
    step = out[0]["at_join"][0]
    assert out[0]["joins"] == [{"joined": [2], "step": step, "members": [0, 1, 2]}]
    for o in out.values():                      # training went on: every member, the same steps, to the target
        assert o["steps"] == step + 150 and o["gen"] == 1
        assert o["accuracy"] >= TARGET, (algorithm, o["accuracy"])
    # the newcomer took rank 0's momentum buffers, except under DiLoCo, whose inner optimizer is each worker's own:
    # it starts afresh (and θ crosses the link once, in the algorithm's state)
    assert out[2]["inner_at_join"] == (0 if algorithm == "diloco" else 4), out[2]     # digits-mlp: 4 tensors
    if algorithm == "bsp":
        assert step >= 1
    else:                                       # the boundary: a model average, a fragment merge, a window's end
        period = params["period"]
        assert step % period == 0, (algorithm, step)


def test_a_newcomer_takes_the_live_state_never_supplies_it_and_takes_part_in_the_next_sync(epool):
    """A replica that joins a job which has progressed takes a live member's state, whatever its own model (here
    every parameter 1000: had it supplied the state, every member would hold it); every live replica, the
    newcomer included, takes part in the first synchronization after the join, and the metrics say so: the
    ranks of every sync, as runs [first step, last step, ranks]."""
    period = 4
    out = epool.run(_train, "diloco", {"period": period, "outer_lr": 0.6, "outer_momentum": 0.5}, 3, 3 * period,
                    "poison", joins=[("time", 0)])
    assert sorted(out) == [0, 1, 2] and not epool.lost and not epool.refused
    assert [g["kind"] for g in epool.generations] == ["start", "join"]
    step = out[0]["at_join"][0]
    assert step >= period and step % period == 0            # the job had progressed
    assert len({o["at_join"] for o in out.values()}) == 1 and len({o["sha"] for o in out.values()}) == 1
    assert all(o["largest_at_join"] < 100 for o in out.values()), [o["largest_at_join"] for o in out.values()]
    for member in (0, 1):   # every sync up to the join among the two, from the next one on among the three
        assert out[member]["participants"] == [[period, step, 2], [step + period, step + 3 * period, 3]]
    assert out[2]["participants"] == [[step + period, step + 3 * period, 3]]


def test_a_newcomer_of_another_configuration_is_refused_and_the_job_goes_on(epool):
    out = epool.run(_train, "localsgd", {"period": 4}, 2, 20, {"period": 8}, joins=[("time", 0)])
    assert sorted(out) == [0, 1] and not epool.lost
    assert epool.refused == {2: "cannot join: the job runs algorithm parameters period 4, this worker 8"}
    assert [g["kind"] for g in epool.generations] == ["start"]
    assert out[0]["sha"] == out[1]["sha"]


def test_a_newcomer_lost_while_it_takes_its_state_leaves_the_members_running(epool):
    out = epool.run(_train, "bsp", {}, 3, 150, "die", joins=[("time", 0)])
    assert sorted(out) == [0, 1]
    assert [e["member"] for e in epool.lost] == [2] and "signal 9" in epool.lost[0]["reason"]
    assert [g["kind"] for g in epool.generations] == ["start", "join", "loss"]
    assert epool.generations[-1]["members"] == [0, 1]
    assert out[0]["sha"] == out[1]["sha"] and out[0]["steps"] == out[1]["steps"]
    assert out[0]["failures"] and out[0]["failures"][0]["lost"] == [2]
    assert out[0]["accuracy"] >= TARGET


def _killing_worker(member, workers, cfg, kill_member, kill_step):
    """`thinwire train`'s worker; member `kill_member` is SIGKILLed as it fetches the batch of `kill_step`."""
    from thinwire.run.loop import train_worker
    if member == kill_member:
        calls = [0]
        original = workloads.ShardLoader.next

        def next_batch(self):
            calls[0] += 1
            if calls[0] == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self)
        workloads.ShardLoader.next = next_batch
    return train_worker(member, workers, cfg)


def test_a_checkpoint_taken_after_a_change_of_membership_resumes_bitwise(epool, tmp_path):
    """`thinwire train --elastic`'s loop: member 1 is lost at step 12; the checkpoint of step 24 is the
    survivor's (its generation's shard and loader); resumed, the run ends with the uninterrupted run's model."""
    from thinwire.run.train import TrainConfig, run_elastic, summarize
    base = dict(workload="digits-mlp", algorithm="bsp", workers=2, elastic="1:3", steps=36, eval_every=12,
                progress=False)
    cfg = TrainConfig(**base, checkpoint_every=24, checkpoint_dir=str(tmp_path / "ck")).validate()
    out = epool.run(_killing_worker, cfg, 1, 12, replace=False)
    assert sorted(out) == [0] and [e["member"] for e in epool.lost] == [1]
    assert [g["members"] for g in epool.generations] == [[0, 1], [0]]
    summary, rows = summarize(cfg, [out[0]], 1.0)
    assert [r["step"] for r in rows] == list(range(1, 37)) and summary["failures"][0]["lost"] == [1]
    resumed = run_elastic(TrainConfig(**{**base, "workers": 1}, resume=str(tmp_path / "ck")).validate())
    assert resumed["model_sha256"] == out[0]["model_sha256"]
    assert resumed["steps"] == 36


def test_a_join_scheduled_at_a_step_fires_and_the_newcomer_takes_part(epool):
    """`joins=[("step", k)]` starts a newcomer once a member reported step k: the members' progress reaches the
    launcher (before, elastic workers reported none and such a join never fired)."""
    out = epool.run(_train, "bsp", {}, 3, 20, joins=[("step", 5)])
    assert sorted(out) == [0, 1, 2] and not epool.lost and not epool.refused
    assert [g["kind"] for g in epool.generations] == ["start", "join"]
    assert len({o["at_join"] for o in out.values()}) == 1 and len({o["sha"] for o in out.values()}) == 1
    step = out[0]["at_join"][0]
    assert step >= 5 and all(o["steps"] == step + 20 and o["gen"] == 1 for o in out.values())


def _stalls(member, workers):
    """Member 1 reports steps 1-3 and stops; member 0 reports step 4 too and waits (as in that step's collective)."""
    for step in range(1, 5 if member == 0 else 4):
        tw.report_progress(step)
    time.sleep(30)


def test_a_stalled_member_is_named_within_the_progress_bound(epool):
    """The progress watchdog watches an elastic job's members: member 1, stuck at step 3 while member 0 waits at
    step 4, is named (a run with no progress watchdog would end after the members' 30 s sleep, unnamed). Last of
    the tests on `epool`: the failure closes it."""
    epool.progress_timeout = 2.0
    with pytest.raises(tw.WorkerError, match=r"member 1 made no progress for \d+ s \(stuck at step 3; others at "
                                             r"step 4\)") as err:
        epool.run(_stalls)
    assert err.value.rank == 1


def test_join_where_nothing_listens_fails_in_one_line():
    """`thinwire train --join HOST:PORT` to a closed port: exit status 2 and one line on stderr, well within the
    30 s it is given (before: 58 s, and 39-50 lines of C++ stack dumps from the store's client first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]     # bound, never listening: closed
    out = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "linreg", "--join",
                          f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=35)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"thinwire: error: cannot reach the elastic job at 127.0.0.1:{port}: "), out.stderr


def test_join_to_an_address_that_answers_as_no_store_fails_in_one_line(monkeypatch, capfd):
    """An address that accepts the connection and answers something else (an HTTP server): one line, and none of
    the store client's C++ stack dumps on stderr."""
    from thinwire.errors import UserError
    from thinwire.launcher import elastic as launcher
    monkeypatch.setattr(launcher, "STORE_ANSWER_S", 1.0)
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
    threading.Thread(target=answer, daemon=True).start()
    port = server.getsockname()[1]
    try:
        with pytest.raises(UserError, match=f"cannot reach the elastic job at 127.0.0.1:{port}: it answers, but as "
                                            f"no thinwire job's store") as err:
            launcher.join_by_hand(f"127.0.0.1:{port}", _stalls)
    finally:
        server.close()
    assert "\n" not in str(err.value) and capfd.readouterr().err == ""


def test_a_refusal_names_the_first_difference():
    """(one process) The job's description against a newcomer's: one line naming the entry that differs."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = elastic.Member(dist.PrefixStore("t/", store), 0, joining=False)
    model = [["0.weight", [64, 64], "torch.float32"], ["0.bias", [64], "torch.float32"]]
    job.agree("trainer", {"algorithm": "bsp", "model": model})
    newcomer = elastic.Member(dist.PrefixStore("t/", store), 5, joining=True)
    newcomer.agree("trainer", {"algorithm": "bsp", "model": model})           # the same: accepted
    with pytest.raises(elastic.JoinRefused) as e:
        newcomer.agree("trainer", {"algorithm": "bsp", "model": [model[0], ["0.bias", [32], "torch.float32"]]})
    assert str(e.value) == ("cannot join: the job runs model [\"0.bias\", [64], \"torch.float32\"], this worker "
                            "[\"0.bias\", [32], \"torch.float32\"]")
    with pytest.raises(elastic.JoinRefused, match="the job runs algorithm 'bsp', this worker 'dts'"):
        newcomer.agree("trainer", {"algorithm": "dts", "model": model})


def test_a_newcomers_state_round_trips_as_tensors_and_json():
    """(one process) What rank 0 sends a newcomer: comm/state.py's JSON header and one byte buffer, rebuilt
    exactly (optimizer state with int keys, tuples, a 0-d step tensor, bools, None)."""
    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "amsgrad": False,
                                   "params": [0]}]}
    obj = {"step": 7, "model": [torch.arange(6, dtype=torch.int64), torch.randn(2, 2)], "optimizer": opt_state,
           "algorithm": {"anchor": [torch.randn(3)], "dirty": [True, False]}}
    header, buffer = elastic.state.pack(obj)
    back = elastic.state.decode(header, buffer)
    assert back["step"] == 7 and back["algorithm"]["dirty"] == [True, False]
    assert torch.equal(back["model"][0], obj["model"][0]) and torch.equal(back["model"][1], obj["model"][1])
    got = back["optimizer"]
    assert list(got["state"]) == [0] and torch.equal(got["state"][0]["exp_avg"], opt_state["state"][0]["exp_avg"])
    assert got["param_groups"][0]["betas"] == (0.9, 0.95) and got["param_groups"][0]["foreach"] is None
    with pytest.raises(ValueError):
        elastic.state.decode(header, buffer[:-8])
