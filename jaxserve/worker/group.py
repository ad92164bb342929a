"""A multi-host instance: `instance.hosts` worker processes, one per host, forming one JAX multi-controller program.

Every process joins with `jax.distributed.initialize` (process 0 serves the coordinator on the group's port;
CPU collectives run over gloo), builds the same engine with its mesh over every process's devices (TP across the
hosts: each process holds its devices' shards of the weights and of the KV pool), and so runs the same step
programs. Only process 0, the leader, is a worker as a one-host instance is: it registers with the router,
serves gRPC, schedules, and sends and receives KV. The others follow. The leader's engine drives a `Lockstep`
in place of its ModelRunner: each runner call (method and arguments) goes to every follower over the group
channel (the port after the coordinator's; multiprocessing.connection, authenticated with a key derived from
the cluster token; messages in `encode`'s format: JSON and raw array bytes, dataclasses only of the runner's
argument types, never pickle) before the leader runs it, and a follower (`follow`) runs the same calls in the
same order on its own runner, so every process enters each program, and its collectives, in the same order (the
overlapped loop's `dispatch` too: the leader alone reads a step's replicated tokens, `collect`, with the next step
already dispatched everywhere; a follower's runner keeps each slot's last token on its own devices). A
call that runs callbacks between its programs (a layer-wise prefill's on_stage / before_stage, which export and
import KV; the sampler's masks) is run with callbacks that replay the calls the leader's callbacks made, up to
their end marker, which carries what the leader's callback returned (a step's next-token bitmasks, which only
the leader's grammar matchers can fill).

KV leaves and enters through the leader: the export program gathers every process's KV heads (a mesh that
spans processes sends no head parts, cache/layout.py `head_parts`), so the leader reads it whole, and the
bytes an import writes travel to the followers with the call (each process writes its own heads).

The group lives and dies as one. The leader watches each follower's connection and exits when one closes (the
router then marks the instance down and fails its requests over); a follower exits when the leader's
connection closes. Restarting it is the launcher's: a LeaderWorkerSet recreates the group
(RecreateGroupOnPodRestart), the local launcher restarts its processes together (router/launcher.py).

Where a process finds its place: `--coordinator HOST:PORT --num-processes N --process-id I`, or the
LeaderWorkerSet's variables (`LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`, the port
`instance.group_port`, else DEFAULT_PORT).

Concurrency: on the leader, the engine thread sends (each Lockstep call) and one watcher thread per follower
waits for its connection to close; a follower is one thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
from multiprocessing.connection import Client, Listener

from ..config import ConfigFileError

log = logging.getLogger("jaxserve.group")
DEFAULT_PORT = 8476  # the coordinator's port where the config names none (Kubernetes); the channel's is the next
JOIN_S = 300.0  # how long the group's processes may take to find each other (engines built, channel open)
# the runner's calls that run programs or change its state: what a follower repeats
CALLS = frozenset({"prefill", "generate", "dispatch", "mixed", "insert", "read_blocks", "write_blocks",
                   "export_kv", "import_kv", "settle", "warmup", "warmup_transfer", "free", "stream_layers"})
HOOKS = ("on_stage", "before_stage", "masks")  # callbacks a call runs between its programs


@dataclass(frozen=True)
class Group:
    """This process's place in its instance's group."""
    host: str  # the leader's host (the coordinator's)
    port: int  # the coordinator's port; the group channel's is port + 1
    size: int  # processes in the group (instance.hosts)
    index: int  # this process's (0: the leader)

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def coordinator(self) -> str:
        return f"{self.host}:{self.port}"


def _int(value: str, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigFileError(f"{what}: not an integer: {value!r}") from None


def resolve(inst, coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env=None) -> Group | None:
    """This process's Group from the flags, or else from the LeaderWorkerSet's environment; None for an
    instance of one host. ConfigFileError (naming the flag, variable or field) where they do not fit the
    config's instance.hosts."""
    env = os.environ if env is None else env
    where = f"clusters.instances[{inst.name}].hosts"
    flags = (coordinator, num_processes, process_id)
    if any(f is not None for f in flags):
        if any(f is None for f in flags):
            raise ConfigFileError("--coordinator, --num-processes and --process-id go together")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ConfigFileError(f"--coordinator must be HOST:PORT (a port below 65535), got {coordinator!r}")
        group = Group(host, int(port), num_processes, process_id)
        source = "--num-processes"
    elif env.get("LWS_GROUP_SIZE"):
        size = _int(env["LWS_GROUP_SIZE"], "LWS_GROUP_SIZE")
        if size == 1 and inst.hosts == 1:
            return None
        if not env.get("LWS_LEADER_ADDRESS"):
            raise ConfigFileError("LWS_GROUP_SIZE is set but LWS_LEADER_ADDRESS is not")
        group = Group(env["LWS_LEADER_ADDRESS"], inst.group_port or DEFAULT_PORT, size,
                      _int(env.get("LWS_WORKER_INDEX", "0"), "LWS_WORKER_INDEX"))
        source = "LWS_GROUP_SIZE"
    elif inst.hosts > 1:
        raise ConfigFileError(f"{where}: {inst.hosts}, so this worker needs its place in the group: --coordinator, "
                              "--num-processes and --process-id, or the LeaderWorkerSet's LWS_* variables")
    else:
        return None
    if group.size != inst.hosts:
        raise ConfigFileError(f"{where}: {inst.hosts}, but {source} says {group.size} processes")
    if not 0 <= group.index < group.size:
        raise ConfigFileError(f"this process's index in the group ({group.index}) is not in 0..{group.size - 1}")
    return group


def join(group: Group) -> None:
    """jax.distributed.initialize for `group` (before any JAX computation; CPU collectives over gloo)."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator, group.size, group.index, initialization_timeout=int(JOIN_S))


_TYPES: dict[str, type] = {}  # the dataclasses a message may hold (runner arguments), by name


def _types() -> dict[str, type]:
    if not _TYPES:
        from jaxserve.transfer.plan import ArraySpec, Staging

        from ..engine.rows import DecodeRow, PrefillRow, Prefix
        from ..sampling import SamplingParams
        from ..structured import Guided
        _TYPES.update({t.__name__: t for t in (PrefillRow, DecodeRow, Prefix, SamplingParams, Guided, Staging,
                                               ArraySpec)})
    return _TYPES


def encode(msg) -> bytes:
    """A message (None, numbers, strings, lists, tuples, sets, dicts, numpy arrays and scalars, and the runner's
    argument dataclasses, nested) -> bytes: a length-prefixed JSON tree, then the arrays' raw bytes."""
    bufs: list[bytes] = []
    metas: list = []

    def tree(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            metas.append([a.dtype.str, list(a.shape)])
            bufs.append(a.tobytes())
            return {"A": len(bufs) - 1}
        if isinstance(x, np.generic):
            return {"N": [x.dtype.str, x.item()]}
        if isinstance(x, (list, tuple, set, frozenset)):
            tag = {list: "L", tuple: "T", set: "S", frozenset: "F"}[type(x)]
            return {tag: [tree(v) for v in x]}
        if isinstance(x, dict):
            return {"D": [[tree(k), tree(v)] for k, v in x.items()]}
        if dataclasses.is_dataclass(x) and type(x).__name__ in _types():
            return {"C": type(x).__name__, "f": {f.name: tree(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        raise TypeError(f"the group channel does not carry {type(x).__name__}")
    head = json.dumps({"v": tree(msg), "a": metas}).encode()
    return struct.pack("<I", len(head)) + head + b"".join(bufs)


def decode(data: bytes):
    """`encode`'s bytes -> the message (dataclasses only of the allowed types; nothing in it runs)."""
    (n,) = struct.unpack_from("<I", data)
    head = json.loads(data[4:4 + n])
    arrays, pos = [], 4 + n
    for dtype, shape in head["a"]:
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are not carried")
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(data, dt, count, pos).reshape(shape).copy())
        pos += count * dt.itemsize
    types = _types()

    def tree(x):
        if not isinstance(x, dict):
            return x
        tag, v = next(iter(x.items()))
        if tag == "A":
            return arrays[v]
        if tag == "N":
            return np.dtype(v[0]).type(v[1])
        if tag in ("L", "T", "S", "F"):
            return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](tree(i) for i in v)
        if tag == "D":
            return {tree(k): tree(i) for k, i in v}
        if tag == "C" and v in types:
            return types[v](**{k: tree(i) for k, i in x["f"].items()})
        raise ValueError(f"not a group message: {tag!r}")
    return tree(head["v"])


def _authkey(token: str | None) -> bytes:
    return hashlib.sha256(b"jaxserve-group:" + (token or "").encode()).digest()


def exit_now(code: int) -> None:
    """End this process at once: the group's processes do not wait for each other in jax.distributed's
    shutdown barrier (one of them may be gone). Its shared-memory segments go first (os._exit runs no atexit)."""
    from jaxserve.transfer.bufpool import remove_owned
    remove_owned()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LeaderChannel:
    """The leader's end: listens from the start (followers connect once their engines are built), `accept`
    takes every follower, `send` encodes a message once for all of them."""

    def __init__(self, group: Group, bind_host: str, token: str | None, on_lost=None):
        """on_lost(index): a follower's connection closed before `close` (default: this process exits)."""
        self.group = group
        self._listener = Listener((bind_host, group.port + 1), authkey=_authkey(token))
        self.conns: dict[int, object] = {}
        self.closing = False
        self._on_lost = on_lost or (lambda index: exit_now(1))

    def accept(self, timeout: float = JOIN_S) -> None:
        """Wait until every follower has connected (ConfigFileError after `timeout`); then watch them."""
        done = threading.Event()

        def take():
            try:
                while len(self.conns) < self.group.size - 1:
                    conn = self._listener.accept()
                    self.conns[int(conn.recv_bytes(16))] = conn
            except Exception as e:  # noqa: BLE001 - a bad handshake: reported as missing followers below
                log.error("group channel: %s", e)
            done.set()
        threading.Thread(target=take, name="group-accept", daemon=True).start()
        if not done.wait(timeout) or sorted(self.conns) != list(range(1, self.group.size)):
            raise ConfigFileError(f"the group's followers {sorted(set(range(1, self.group.size)) - set(self.conns))}"
                                  f" did not connect to {self.group.host}:{self.group.port + 1} within {timeout:.0f}s")
        for index, conn in self.conns.items():
            threading.Thread(target=self._watch, args=(index, conn), name=f"group-watch-{index}", daemon=True).start()

    def _watch(self, index: int, conn) -> None:
        try:
            conn.recv_bytes()  # a follower sends nothing after its index: this returns when it is gone
        except (EOFError, OSError):
            pass
        if not self.closing:
            log.error("process %d of this instance's group is gone: the instance goes down", index)
            self._on_lost(index)

    def send(self, msg: tuple) -> None:
        data = encode(msg)
        for conn in self.conns.values():
            conn.send_bytes(data)

    def close(self) -> None:
        """Tell the followers to exit, and close."""
        self.closing = True
        for conn in self.conns.values():
            try:
                conn.send_bytes(encode(("exit",)))
                conn.close()
            except OSError:
                pass
        self._listener.close()


def connect(group: Group, token: str | None, timeout: float = JOIN_S):
    """A follower's end of the channel (retried until the leader listens) -> the connection."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client((group.host, group.port + 1), authkey=_authkey(token))
            break
        except (ConnectionRefusedError, OSError) as e:
            if time.monotonic() > deadline:
                raise ConfigFileError(f"process {group.index} could not reach its group's leader at "
                                      f"{group.host}:{group.port + 1}: {e}") from None
            time.sleep(0.2)
    conn.send_bytes(str(group.index).encode())
    return conn


class Lockstep:
    """The leader's ModelRunner as the engine sees it: every call in CALLS goes to the followers first, its
    callbacks wrapped so that the followers learn where each ends; anything else is the runner's own. A
    constrained step is not split (runner.forward / pick are the leader's alone): it runs as one `dispatch`."""

    splits_ahead = False

    def __init__(self, runner, channel: LeaderChannel):
        self._runner, self._channel = runner, channel
        self._sigs: dict[str, inspect.Signature] = {}  # each call's signature, taken on its first use

    def __getattr__(self, name: str):
        attr = getattr(self._runner, name)
        if name not in CALLS:
            return attr
        sig = self._sigs.get(name) or self._sigs.setdefault(name, inspect.signature(attr))

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            if bound.arguments.get("remote") is not None:
                raise RuntimeError("a multi-host instance takes no part in migrations")
            sent = dict(bound.arguments)
            hooks = [h for h in HOOKS if sent.get(h) is not None]
            for h in hooks:
                sent[h] = None
                bound.arguments[h] = self._hook(bound.arguments[h])
            self._channel.send(("call", name, sent, hooks))
            return attr(*bound.args, **bound.kwargs)
        return call

    def _hook(self, fn):
        def hook(k):
            try:
                value = fn(k)
            except BaseException:
                self._channel.send(("hook_raised",))
                raise
            self._channel.send(("hook_done", value))
            return value
        return hook


class _LeaderRaised(Exception):
    """The leader's callback raised: the call it ran in ends here too."""


def follow(runner, conn) -> int:
    """A follower's life: run the leader's calls on `runner` until it says exit (-> 0) or its connection
    closes (-> 1)."""
    def recv():
        return decode(conn.recv_bytes())

    def hook(k):
        while True:
            msg = recv()
            if msg[0] == "hook_done":
                return msg[1]
            if msg[0] == "hook_raised":
                raise _LeaderRaised()
            run(msg)

    def run(msg):
        _, name, kwargs, hooks = msg
        for h in hooks:
            kwargs[h] = hook
        if "progress" in kwargs:
            kwargs["progress"] = False
        try:
            getattr(runner, name)(**kwargs)
        except _LeaderRaised:
            pass
        except Exception as e:  # noqa: BLE001 - the leader's call raised the same (it checks the same arguments)
            log.warning("%s raised %s: %s (on the leader too)", name, type(e).__name__, e)

    while True:
        try:
            msg = recv()
        except (EOFError, OSError):
            log.error("the group's leader is gone: this process exits")
            return 1
        if msg[0] == "exit":
            return 0
        run(msg)
