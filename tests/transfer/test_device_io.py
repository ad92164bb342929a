"""transfer/device.py with the pool on a device other than the one numpy's DLPack views land on (as an
accelerator's pool is): the export reaches host memory once (`host_copies`: pinned host memory, `to_host`), the
import lands the received arrays on the pool's own device, and the round trip moves exactly the request's KV."""

from __future__ import annotations

import jax
import numpy as np

from tests import in_place
from tests.transfer.helpers import export, layout, random_pool
from jaxserve.transfer.device import DeviceIO, host_copies, to_host
from jaxserve.transfer.plan import TransferPlan, layer_groups


def test_a_pool_off_the_default_device_exports_and_imports_in_place():
    dev = jax.devices()[1]
    assert dev != jax.devices()[0]
    lay = layout()
    src, dst = [3, 4, 9, 10], [7, 8, 9, 20]
    groups = layer_groups(lay.num_layers, 2)
    st = TransferPlan.build(lay, "float32", 14, src, dst, 0, groups).check(lay, "float32", dst, 14, 0)
    io = DeviceIO()
    sender = jax.device_put(random_pool(lay, seed=0), dev)
    items = [it for k in range(len(groups)) for it in io.export(sender, st, k, src, 1)]
    assert all(x.devices() == {dev} for _, x in items)
    assert host_copies(items) == items  # a CPU's arrays are host memory already: sent as they are
    items = host_copies(items, pinned=True)  # as on an accelerator: one copy each into pinned host memory
    assert all(x.sharding.memory_kind == "pinned_host" and x.devices() == {dev} for _, x in items)
    sent = dict((i, to_host(x)) for i, x in items)
    assert all(sent[i].ctypes.data == x.unsafe_buffer_pointer() for i, x in items)  # viewed, not copied again
    want = export(lay, random_pool(lay, seed=0), st, src, 1)  # numpy's own staging of the same KV
    assert sorted(sent) == list(range(len(want)))
    for i, x in enumerate(want):
        np.testing.assert_array_equal(sent[i], x)
    before = random_pool(lay, seed=1)
    got = io.import_(jax.device_put(before, dev), st, [np.array(sent[i]) for i in range(len(want))], dst, 0,
                     lay.num_blocks)
    assert all(x.devices() == {dev} for x in jax.tree.leaves(got))
    got = jax.tree.map(np.asarray, got)
    for i, x in enumerate(export(lay, got, st, dst, 0)):  # what arrived, read back where it was written
        np.testing.assert_array_equal(x[:len(want[i])], want[i])
    calls = []  # again, its arguments recorded: the import program writes the pool in place, copying none of it
    (key, program), = io._import.items()
    io._import[key] = lambda *a: (calls.append(a), program(*a))[1]
    io.import_(jax.device_put(before, dev), st, [np.array(sent[i]) for i in range(len(want))], dst, 0, lay.num_blocks)
    assert in_place.check(program, calls[0], {}, calls[0][0]) == (True, [])
    untouched = [b for b in range(lay.num_blocks) if b not in dst]
    for g, (a, b) in enumerate(zip(got, before)):
        if not isinstance(a, dict) and a.shape[0] == lay.num_blocks:  # block arrays: the others as they were
            np.testing.assert_array_equal(a[untouched], b[untouched], err_msg=f"group {g}")
