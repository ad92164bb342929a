"""A TCP fault proxy for partition and corruption tests: it forwards connections to a target and, on command,
stops forwarding without closing anything (`blackhole`: a silent partition, no reset, no FIN), cuts every
connection (`reset`), or flips one bit in each forwarded chunk from client to target (`corrupt`; with
`only_from`, only on connections from those client addresses). Concurrency: an accept thread and two pump threads per connection; `mode` is read by every pump.
"""

from __future__ import annotations

import socket
import threading

MODES = ("pass", "blackhole", "reset", "corrupt")


class FaultProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1"):
        self.target = (target[0], int(target[1]))
        self._sock = socket.create_server((host, 0))
        self.address = self._sock.getsockname()[:2]
        self._mode = "pass"
        self._only: frozenset | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    @property
    def mode(self) -> str:
        return self._mode

    def set(self, mode: str, only_from=None) -> None:
        """only_from: client IP addresses whose traffic `corrupt` flips (None: every connection's)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._only = None if only_from is None else frozenset(only_from)
        self._mode = mode
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "reset":
            with self._lock:
                pairs, self._pairs = self._pairs, []
            for a, b in pairs:
                for s in (a, b):
                    try:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        s.close()
                    except OSError:
                        pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.set("reset")

    def _accept(self) -> None:
        while True:
            try:
                client, peer = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self._mode == "blackhole":  # accepted by the kernel, never answered
                with self._lock:
                    self._pairs.append((client, client))
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, peer[0]), name="fault-proxy-pump",
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool, peer: str) -> None:
        try:
            while True:
                self._flowing.wait()
                data = src.recv(1 << 16)
                if not data:
                    break
                self._flowing.wait()  # blackholed while this chunk was read: it goes nowhere until restored
                if self._mode == "corrupt" and upstream and (self._only is None or peer in self._only):
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x01
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
