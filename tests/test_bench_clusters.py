"""bench/clusters.py `unpinned`: the suite's workers run on any core (the soak holds the first, tests/test_soak.py)."""

from bench.clusters import unpinned
from jaxserve.config import parse


def test_unpinned_leaves_out_every_instances_cores_and_changes_no_copy_it_was_given():
    cfg = {"model": {"path": "bundled"},
           "clusters": [{"name": "a", "kind": "prfaas", "instances": [{"name": "a0", "role": "prefill", "cpus": [0]}]},
                        {"name": "b", "instances": [{"name": "b0", "role": "prefill", "cpus": [1]},
                                                    {"name": "b1", "role": "decode", "cpus": [0, 1]}]}],
           "links": [{"src": "a", "dst": "b"}]}
    free = unpinned(cfg)
    assert [i.cpus for i in parse(free).instances()] == [[], [], []]
    assert [i.cpus for i in parse(cfg).instances()] == [[0], [1], [0, 1]]  # the original still pins
    assert {**free, "clusters": None} == {**cfg, "clusters": None}  # the rest as it was
    assert [[i["name"] for i in c["instances"]] for c in free["clusters"]] == [["a0"], ["b0", "b1"]]
