"""transfer/device.py with the pool on a device other than the one numpy's DLPack views land on (as an
accelerator's pool is): the export reaches host memory once (`host_copies`: pinned host memory, `to_host`), the
import lands the received arrays on the pool's own device, and the round trip moves exactly the request's KV."""

from __future__ import annotations

import jax
import numpy as np

from tests import in_place
from tests.transfer.helpers import export, layout, random_pool
from jaxserve.transfer.device import DeviceIO, host_copies, to_host
from jaxserve.transfer.plan import TransferPlan, layer_groups, staging


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


def test_spans_export_and_import_with_the_programs_of_unsplit_transfers():
    """A staging in spans of 4 rows (11 blocks): each span is exported and imported by the program of an unsplit
    transfer of its rows (no other program compiled), an earlier span's rings and state are not exported, and
    the pool it leaves equals the unsplit transfer's; the spans before the last write their state on the spare
    row, the last on the request's."""
    lay = layout()
    src = [3, 4, 9, 10, 11, 12, 13, 14, 25, 26, 27]
    dst = [7, 8, 9, 20, 21, 22, 23, 28, 29, 30, 31]
    n, groups = 43, layer_groups(lay.num_layers, 2)
    plan = TransferPlan.build(lay, "float32", n, src, dst, 0, groups, span_rows=4)
    st, whole = plan.check(lay, "float32", dst, n, 0), staging(lay, "float32", 11, groups)
    pool = jax.device_put(random_pool(lay, seed=0))
    io, ref = DeviceIO(), DeviceIO()
    first = [it for k in range(len(groups)) for it in io.export(pool, st, k, src, 1, spans=[0])]
    assert {st.arrays[i].span for i, _ in first} == {0} and {st.arrays[i].kind for i, _ in first} == {"blocks"}
    items = dict(first + [it for k in range(len(groups)) for it in io.export(pool, st, k, src, 1, spans=[1, 2])])
    want = export(lay, random_pool(lay, seed=0), st, src, 1)
    assert sorted(items) == list(range(len(want)))
    for i, x in enumerate(want):  # (the pad rows are not sent)
        n = st.arrays[i].rows if st.arrays[i].kind == "blocks" else len(x)
        np.testing.assert_array_equal(np.asarray(items[i])[:n], x[:n])
    for rows in (4, 3):  # the unsplit programs of a span's rows: the same keys, nothing more
        for k in range(len(groups)):
            ref.export(pool, staging(lay, "float32", rows, groups), k, src[:rows], 1)
    assert set(io._export) == set(ref._export)
    before = random_pool(lay, seed=1)
    got = io.import_(jax.device_put(before), st, [np.array(items[i]) for i in range(len(want))], dst, 0,
                     lay.num_blocks, spare_row=1)
    unsplit = ref.import_(jax.device_put(before), whole, export(lay, random_pool(lay, seed=0), whole, src, 1), dst, 0,
                          lay.num_blocks)
    for a, b in zip(jax.tree.leaves(got)[:1], jax.tree.leaves(unsplit)[:1]):  # the full group's blocks
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for g in (1, 2):  # ring and state: row 0 as the unsplit import left it; spare row 1 written by earlier spans
        for a, b in zip(jax.tree.leaves(got[g]), jax.tree.leaves(unsplit[g])):
            np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
            np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[0])
    for rows in (4, 3):
        sub = staging(lay, "float32", rows, groups)
        ref.import_(jax.device_put(before), sub, export(lay, random_pool(lay, seed=0), sub, src[:rows], 1), dst, 0,
                    lay.num_blocks)
    assert set(io._import) <= set(ref._import)
