"""Multi-host instances (worker/group.py) for real: each instance two worker processes with a CPU device each,
one JAX multi-controller program over both (jax.distributed on 127.0.0.1, gloo collectives, the KV heads and
weights split over the two processes, restored from an Orbax checkpoint), behind the router, disaggregated:
greedy answers equal to a one-process instance's. Then a fault: one process of the decode group is killed; the group goes down, the router marks the
instance down and fails the request in flight over (no request hangs); the group, started again as a unit,
serves again. And where a process finds its place in the group: flags, LeaderWorkerSet variables, clear errors.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from jaxserve.config import ConfigFileError, InstanceSection
from jaxserve.worker.group import DEFAULT_PORT, Group, resolve
from tests.router.test_cluster_http import BASE, complete, disagg_config, serving, tokens, worker_stats
from tests.router.test_faults import check_no_leak, reference, wait_for
from jaxserve.transfer.bufpool import SHM_DIR


def test_place_from_flags_and_from_leaderworkerset_variables():
    inst = InstanceSection(name="p0", hosts=2, tp=2)
    assert resolve(inst, "10.0.0.5:9000", 2, 1, env={}) == Group("10.0.0.5", 9000, 2, 1)
    lws = {"LWS_LEADER_ADDRESS": "lws-p0-0.lws-p0", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    assert resolve(inst, env=lws) == Group("lws-p0-0.lws-p0", DEFAULT_PORT, 2, 1)
    assert resolve(InstanceSection(name="p0", hosts=2, tp=2, group_port=7000), env=lws).port == 7000
    assert resolve(InstanceSection(name="p0"), env={"LWS_GROUP_SIZE": "1"}) is None  # a group of one host
    assert resolve(InstanceSection(name="p0"), env={}) is None
    with pytest.raises(ConfigFileError, match=r"hosts\]?: 2, so this worker needs its place"):
        resolve(inst, env={})
    with pytest.raises(ConfigFileError, match="go together"):
        resolve(inst, "h:1", 2, None, env={})
    with pytest.raises(ConfigFileError, match="HOST:PORT"):
        resolve(inst, "h", 2, 0, env={})
    with pytest.raises(ConfigFileError, match=r"hosts: 2, but --num-processes says 3"):
        resolve(inst, "h:1", 3, 0, env={})
    with pytest.raises(ConfigFileError, match=r"hosts: 2, but LWS_GROUP_SIZE says 4"):
        resolve(inst, env={**lws, "LWS_GROUP_SIZE": "4"})
    with pytest.raises(ConfigFileError, match=r"index in the group \(2\)"):
        resolve(inst, "h:1", 2, 2, env={})
    with pytest.raises(ConfigFileError, match="LWS_WORKER_INDEX: not an integer"):
        resolve(inst, env={**lws, "LWS_WORKER_INDEX": "x"})


def test_config_refuses_groups_it_cannot_split():
    with pytest.raises(ValueError, match="cannot share tp=3"):
        InstanceSection(name="p0", hosts=2, tp=3)
    with pytest.raises(ValueError, match="a store runs no model step"):
        InstanceSection(name="s0", role="store", hosts=2, tp=2)
    assert InstanceSection(name="p0", hosts=2, tp=4, devices=[0, 1]).hosts == 2  # two devices on each host


def group_config(path: str) -> dict:
    cfg = disagg_config(path)
    for inst in cfg["clusters"][0]["instances"]:
        inst.update(hosts=2, tp=2)
    return cfg


@pytest.mark.slow
def test_two_process_instances_serve_disaggregated_and_go_down_as_one(checkpoint_dir, tmp_path):
    from jaxserve.checkpoint import convert
    from jaxserve.models.config import load_config
    path = checkpoint_dir("llama")
    prompts = [BASE[:13], BASE[:21], [30, 31] + BASE[:11]]
    want = [reference(path, p, 6) for p in prompts]  # one process, from the Hugging Face checkpoint
    # the groups restore an Orbax conversion of it, each process its shards
    orbax = convert(path, str(tmp_path / "orbax"), load_config(path), "float32", progress=False)
    with serving(group_config(orbax)) as (client, cluster):
        for p, w in zip(prompts, want):
            body = complete(client, p)
            meta = body["jaxserve"]
            assert meta["prefill_instance"] == "p0" and meta["decode_instance"] == "d0", meta
            assert meta["kv_bytes_transferred"] > 0
            assert tokens(body["choices"][0]) == w
        check_no_leak(cluster)
        # d0's group decoded with steps left in flight (its followers repeat each dispatch), answers unchanged
        assert worker_stats([cluster.registry.workers["d0"]])["d0"]["overlapped_steps"] > 0

        # one process of d0's group (not the one the router talks to) dies while a request decodes there
        d0 = cluster.launcher.children["d0"]
        follower = d0.members[1].proc
        box = {}
        t = threading.Thread(target=lambda: box.update(r=client.post("/v1/completions", json={
            "model": "m", "prompt": BASE[:9], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})))
        t.start()
        wait_for(lambda: cluster.registry.workers["d0"].inflight == 1, what="d0's Decode call")
        os.kill(follower.pid, signal.SIGKILL)
        wait_for(lambda: d0.members[0].exited() is not None, 60, "d0's leader to go down with its group")
        gone = f"jaxserve-kv-{d0.members[0].pid}-"  # its receive pool: removed by the leader itself (os._exit)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(gone)]
        t.join(180)
        assert not t.is_alive(), "the request hung"
        r = box["r"]
        assert r.status_code == 200, r.text
        assert tokens(r.json()["choices"][0]) == reference(path, BASE[:9], 40)
        wait_for(lambda: not client.get("/health").json()["instances"]["d0"]["up"], 30, "d0 marked down")

        # the group starts again as a unit and serves
        cluster.launcher.start_one("d0")
        deadline = time.monotonic() + 300
        while not client.get("/health").json()["instances"]["d0"]["up"]:
            assert cluster.launcher.children["d0"].exited() is None, cluster.launcher.children["d0"].output()
            assert time.monotonic() < deadline, "d0 did not come back"
            time.sleep(0.2)
        body = complete(client, prompts[0])
        assert body["jaxserve"]["decode_instance"] == "d0" and tokens(body["choices"][0]) == want[0]
        check_no_leak(cluster)


class Recorder:
    """A runner that records what it is asked to do (the programs of a two-stage prefill, with its callbacks)."""

    def __init__(self):
        self.calls: list = []

    def prefill(self, rows, stages=None, on_stage=None, staged=None, before_stage=None):
        self.calls.append(("prefill", rows, stages))
        for k in range(len(stages or [None])):
            if before_stage is not None:
                before_stage(k)
            self.calls.append(("program", k))
            if on_stage is not None:
                on_stage(k)
        return ["first token"]

    def export_kv(self, staging, layer_group, blocks, row):
        self.calls.append(("export", staging, layer_group, blocks, row))
        return [(0, "array")]

    def import_kv(self, staging, views, blocks, row, layer_groups=None, wait=True):
        self.calls.append(("import", staging, [v.tolist() for v in views], blocks, row, layer_groups, wait))

    def generate(self, rows, remote=None, masks=None):
        if not rows:
            raise ValueError("decode takes 1.. rows")
        self.calls.append(("generate", rows, None if masks is None else masks(rows).tolist()))
        return [(7, 0.0, [])]

    def dispatch(self, rows, remote=None, masks=None):
        self.calls.append(("dispatch", rows))
        return "in flight"

    def collect(self, rows, out):
        self.calls.append(("collect", rows, out))
        return [(8, 0.0, [])]


def _pair(token_leader="tok", token_follower="tok", **kw):
    from jaxserve.router.launcher import free_ports
    from jaxserve.worker.group import LeaderChannel
    port = free_ports(n=2)
    return (LeaderChannel(Group("127.0.0.1", port, 2, 0), "127.0.0.1", token_leader, **kw),
            Group("127.0.0.1", port, 2, 1), token_follower)


def test_followers_replay_the_leaders_calls_in_order_callbacks_included():
    """The group protocol over a real socket: a follower's runner receives the same calls in the same order as
    the leader's, those the leader's callbacks make between a prefill's programs included; a callback that
    raises ends the call there on both; exit ends the follower with 0."""
    import numpy as np

    from jaxserve.worker.group import Lockstep, connect, follow
    channel, fgroup, token = _pair()
    leader, follower, ended = Recorder(), Recorder(), {}
    t = threading.Thread(target=lambda: ended.update(rc=follow(follower, connect(fgroup, token, timeout=30))))
    t.start()
    channel.accept(timeout=30)
    runner = Lockstep(leader, channel)
    exports = []
    assert runner.prefill(["r0"], [(0, 2), (2, 4)], lambda k: exports.append(runner.export_kv("st", k, [3], 1)),
                          None, lambda k: runner.import_kv("st", [np.arange(3) + k], [5], 1, {k}, wait=False)) \
        == ["first token"]
    assert exports == [[(0, "array")]] * 2  # the leader's own results

    def broken(k):
        runner.export_kv("st", k, [4], 2)
        if k == 1:
            raise RuntimeError("the transfer failed")
    with pytest.raises(RuntimeError, match="the transfer failed"):
        runner.prefill(["r1"], [(0, 2), (2, 4), (4, 6)], broken)
    with pytest.raises(ValueError, match="decode takes"):  # refused on both: the follower goes on
        runner.generate([])
    assert runner.generate(["row"]) == [(7, 0.0, [])]
    # a callback's result (a step's bitmasks, which only the leader can compute) reaches the follower
    assert runner.generate(["row"], masks=lambda rows: np.array([[len(rows), 5]])) == [(7, 0.0, [])]
    with pytest.raises(RuntimeError, match="no part in migrations"):
        runner.generate(["row"], remote="a move")
    # the overlapped loop: every process dispatches a step, the leader alone reads the one before
    out = runner.dispatch(["row"])
    assert runner.dispatch(["row 2"]) == "in flight" and runner.collect(["row"], out) == [(8, 0.0, [])]
    channel.close()
    t.join(30)
    assert ended == {"rc": 0}
    assert follower.calls == [c for c in leader.calls if c[0] != "collect"]
    assert [c[0] for c in leader.calls] == [
        "prefill", "import", "program", "export", "import", "program", "export",
        "prefill", "program", "export", "program", "export", "generate", "generate", "dispatch", "dispatch",
        "collect"]
    assert leader.calls[-4][2] == [[1, 5]]


def test_a_group_member_lost_or_refused():
    """A follower's connection closing takes the leader down (its on_lost); the leader's closing ends the
    follower with 1; a follower presenting another cluster token is not taken."""
    from multiprocessing import AuthenticationError

    from jaxserve.worker.group import connect, follow
    lost = threading.Event()
    channel, fgroup, token = _pair(on_lost=lambda index: lost.set())
    box = {}
    t = threading.Thread(target=lambda: box.update(conn=connect(fgroup, token, timeout=30)))
    t.start()  # a follower's connect returns once the leader has taken it
    channel.accept(timeout=30)
    t.join(30)
    box["conn"].close()
    assert lost.wait(30)
    channel.close()

    channel, fgroup, token = _pair(on_lost=lambda index: None)
    ended = {}
    t = threading.Thread(target=lambda: ended.update(rc=follow(Recorder(), connect(fgroup, token, timeout=30))))
    t.start()
    channel.accept(timeout=30)
    for c in channel.conns.values():  # the leader gone without its exit message: its sockets reset
        socket.socket(fileno=os.dup(c.fileno())).shutdown(socket.SHUT_RDWR)
    t.join(30)
    assert ended == {"rc": 1}
    channel.close()

    channel, fgroup, _ = _pair(token_follower="another")
    box = {}
    t = threading.Thread(target=lambda: box.update(err=_refused(connect, fgroup, AuthenticationError)))
    t.start()
    with pytest.raises(ConfigFileError, match=r"followers \[1\] did not connect"):
        channel.accept(timeout=30)
    t.join(30)
    assert box["err"]
    channel.close()


def _refused(connect, group, error) -> bool:
    try:
        connect(group, "another", timeout=30)
    except error:
        return True
    return False


def test_the_channel_codec_round_trips_runner_arguments_and_refuses_the_rest():
    import numpy as np

    from jaxserve.engine.rows import DecodeRow, PrefillRow, Prefix
    from jaxserve.sampling import SamplingParams
    from jaxserve.structured import Guided
    from jaxserve.worker.group import decode, encode
    from jaxserve.transfer.plan import ArraySpec, Staging
    params = SamplingParams(max_tokens=5, stop=("x",), guided=Guided("regex", "[0-9]+", "guided_regex"))
    spec = ArraySpec(0, 1, 0, "blocks", 0, 2, (4, 2, 1, 16, 2, 8), "<u2", 0, rows=3)
    msg = ("call", "prefill", {
        "rows": [PrefillRow("r", [1, 2], 0, [3], 1, 1, None, True, params, 0, [1, 2]),
                 DecodeRow(1, 7, 9, [3, 4], params, 2, None, "r2")],
        "stages": [(0, 2), (2, 4)], "staged": {"r"}, "views": [np.arange(6, dtype=np.uint16).reshape(2, 3)],
        "prefix": Prefix("r", 1, [3], 2, 5, -0.5, [(5, -0.5)], np.array([True, False])),
        "staging": Staging((spec,), 1024, 768), "scalar": np.int32(4), "groups": frozenset({1})}, ["masks"])
    back = decode(encode(msg))
    assert back[:2] == msg[:2] and back[3] == msg[3]
    got, want = back[2], msg[2]
    assert got["rows"] == want["rows"] and got["stages"] == want["stages"] and got["staged"] == {"r"}
    assert got["staging"] == want["staging"] and got["scalar"] == 4 and got["scalar"].dtype == np.int32
    assert got["views"][0].dtype == np.uint16 and (got["views"][0] == want["views"][0]).all()
    assert got["prefix"].top == [(5, -0.5)] and (got["prefix"].prompt_mask == [True, False]).all()
    assert got["groups"] == frozenset({1}) and got["rows"][0].params.guided.param == "guided_regex"
    with pytest.raises(TypeError, match="does not carry"):
        encode(("call", "x", {"f": object()}, []))
    import json
    import struct
    head = json.dumps({"v": {"C": "Popen", "f": {"args": "sh"}}, "a": []}).encode()
    with pytest.raises(ValueError, match="not a group message"):
        decode(struct.pack("<I", len(head)) + head)
