"""Registry and dispatch policy (plain Python, a fake clock)."""

import pytest

from jaxserve.router.policies.base import least_loaded
from jaxserve.router.snapshot import instance_state
from jaxserve.router.registry import Registry, RegistrationError


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def msg(name, role, **kw):
    return {"name": name, "role": role, "address": f"127.0.0.1:{hash(name) % 1000 + 1000}", "max_model_len": 64,
            "pid": 1, **kw}


def test_registration_heartbeat_and_down():
    clock = Clock()
    reg = Registry({"p0": "prefill", "d0": "decode", "b0": "both"}, down_after_s=3.0, now=clock)
    reg.register(msg("p0", "prefill"))
    reg.register(msg("d0", "decode", kv_address=["127.0.0.1", 5000], stats={"running": 2}))
    assert [w.name for w in reg.up("decode")] == ["d0"] and reg.workers["d0"].kv_address == ("127.0.0.1", 5000)
    assert [w.name for w in reg.up("prefill")] == ["p0"]
    clock.t += 2.0
    reg.register(msg("d0", "decode", stats={"running": 1}))  # heartbeat: refreshed, stats replaced
    clock.t += 2.0
    assert [w.name for w in reg.up()] == ["d0"]  # p0 silent for 4 s > 3 s: down
    assert reg.state()["p0"]["down_reason"] == "no heartbeat" and reg.workers["d0"].stats == {"running": 1}
    reg.mark_down("d0", "UNAVAILABLE: connection reset")  # a failed call: down at once
    assert reg.up() == [] and reg.workers["d0"].failures == 1
    reg.register(msg("d0", "decode"))  # answers again
    assert [w.name for w in reg.up()] == ["d0"] and reg.state()["d0"]["down_reason"] is None
    reg.register(msg("d0", "decode", pid=2))  # restarted: a fresh record
    assert reg.workers["d0"].failures == 0
    assert [e[2].split(" ")[0] for e in reg.events] == ["registered", "registered", "down:", "up", "re-registered"]
    b = reg.register(msg("b0", "both"))
    assert b.serves("prefill") and b.serves("decode") and not reg.workers["p0"].serves("decode")


def test_registration_refusals():
    reg = Registry({"p0": "prefill"})
    with pytest.raises(RegistrationError, match="'x' is not an instance of this cluster"):
        reg.register(msg("x", "prefill"))
    with pytest.raises(RegistrationError, match="the config says role 'prefill', the worker 'decode'"):
        reg.register(msg("p0", "decode"))
    with pytest.raises(RegistrationError, match="role must be one of"):
        Registry().register(msg("q", "router"))
    with pytest.raises(RegistrationError, match="needs name, role, address and max_model_len"):
        reg.register({"name": "p0", "role": "prefill"})
    assert reg.workers == {}


def test_least_loaded():
    """Load as the policies see it: registry entries through the snapshot builder."""
    reg = Registry()
    a = reg.register(msg("a", "decode", stats={"waiting": 0, "running": 3, "blocks_free": 10}))
    b = reg.register(msg("b", "decode", stats={"waiting": 1, "running": 0, "blocks_free": 5}))
    c = reg.register(msg("c", "decode", stats={"waiting": 0, "running": 1, "blocks_free": 20}))

    def pick():
        return least_loaded([instance_state(w, "main", "pd") for w in (a, b, c)]).name
    assert pick() == "c"  # fewest reported waiting + running; then most free blocks
    c.inflight = 1
    assert pick() == "b"  # the router's own in-flight count comes first
    b.inflight = 1
    assert pick() == "a"
    assert least_loaded([]) is None
