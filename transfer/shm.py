"""Local backend: a sender on the decode instance's host writes KV straight into its receive region.

The decode worker's receive pool is a POSIX shared-memory segment (bufpool.py, `shared=True`); a reservation
names the segment and the region's offset in it. `ShmLink` maps the segment and is a `TcpLink` for
everything else: the same connections carry the plan, the first-token record and one payload-less PUT frame
per piece, whose writer thread first copies the piece into the segment at its place (the copies of N
connections run in parallel), checksumming each cache-sized part right after copying it, then sends the
header with the piece's checksum. The receiver checks the plan and the bytes' position exactly as for DATA,
verifies the checksum over the region, and answers ACK, or NACK(retry), after which the piece is copied and
announced again. No piece is written before the receiver has accepted the plan, which carries the region's
offset: the receiver refuses an offset that is not the request's region. So the bytes cross once (one memcpy,
no socket), and corruption, resends, refusals and deadlines behave as on TCP. Use only where both ends run
on one host: `same_host` compares kernel boot ids.
"""

from __future__ import annotations

import socket

import numpy as np

from . import wire
from .bufpool import attach_segment
from .tcp import TcpLink


def boot_id() -> str:
    """This host's identity for same-host checks (the kernel boot id, else the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def same_host(other_boot_id: str | None) -> bool:
    return other_boot_id is not None and other_boot_id == boot_id()


class ShmLink(TcpLink):
    def __init__(self, address, token: str, shm_name: str, **kw):
        self.shm_name = shm_name
        self.mapping = np.frombuffer(attach_segment(shm_name), np.uint8)
        super().__init__(address, token, **kw)

    def _ready(self, out) -> bool:
        """A PUT writes into the receiver's memory: only once the receiver has accepted the plan, which names
        the region's offset (receiver.py refuses a plan whose offset is not the request's region)."""
        if out.frame.kind != wire.PUT:
            return True
        at, n = int(out.frame.meta["at"]), len(out.frame.payload)
        if not 0 <= at <= self.mapping.size - n:
            out.sender.link_failed(f"bytes [{at}, {at + n}) lie outside the receive pool ({self.mapping.size} bytes)")
        elif not out.sender.plan_accepted.wait(self.timeouts.ack_s):
            out.sender.link_failed(f"the receiver did not accept the plan within {self.timeouts.ack_s}s")
        return not out.sender.state.final

    def _emit(self, sock: socket.socket, f: wire.Frame, lost: bool) -> None:
        """Writer thread: a PUT's piece is copied into the segment a cache-sized part at a time, each part
        checksummed right after its copy (the bytes are read from memory once); then the header goes out with
        that checksum, and nothing follows it on the wire."""
        if f.kind != wire.PUT:
            return super()._emit(sock, f, lost)
        at = int(f.meta["at"])
        src = np.frombuffer(f.payload, np.uint8)
        check = wire.Checksum()
        for i in range(0, src.size, wire.PIECE):
            dst = self.mapping[at + i:at + min(i + wire.PIECE, src.size)]
            dst[:] = src[i:i + wire.PIECE]
            check.update(dst)
        digest = wire.spoil(check.digest(), lost)
        self.shaper.send(sock, wire.encode_header(wire.Frame(f.kind, f.request_id, f.seq, f.meta, b"", digest)))
