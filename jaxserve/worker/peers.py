"""A worker's view of the other instances: the router's peer table (registry.py `peers`, replaced by each
heartbeat's answer), the links to other instances' KV servers built from it (device pulls, shared memory or TCP,
with a configured inter-cluster link's emulation), the checks a reservation on another instance must pass before
any KV is sent into it, and the wait for a transfer's acknowledgement.

Concurrency: the worker's asyncio loop reads and replaces the table and builds links (the heartbeat thread only
replaces the table, a whole dict at once); each link runs its own transfer threads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..config import Config, InstanceSection

log = logging.getLogger("jaxserve.worker")


class Peers:
    def __init__(self, cfg: Config, inst: InstanceSection, pull_server, client_tls):
        """pull_server: this process's transfer server (transfer/pull.py), None without device transfers;
        client_tls: the TLS context links dial with (None: plaintext)."""
        self.cfg, self.inst = cfg, inst
        self.cluster = cfg.cluster_of(inst.name)
        self.pull_server = pull_server
        self.client_tls = client_tls
        self.table: dict[str, dict] = {}  # the router's peer table, from each heartbeat
        self.links: dict[tuple, tuple[object, float]] = {}  # (address, segment, pull, ipc) -> (link, last used)
        self.link_bandwidth: dict[str, float] = {}  # cluster -> Gbit/s set at run time (SetLink)
        self.refresh = None  # async () -> None: one registration with the router now (None: no router)
        self._names = {i.name for i in cfg.instances()}

    def pull_source(self, address: str) -> bool:
        """Whether a PULL frame's transfer-server address belongs to a registered prefill instance."""
        return any(p.get("pull_address") == address for p in list(self.table.values()))

    async def get(self, name: str, decode: bool = False) -> dict | None:
        """Instance `name` from the router's peer table; asks the router once more on a miss (an instance that
        registered since this worker's last heartbeat) and, with `decode`, when the table says it does not
        decode (it changed its role since)."""
        peer = self.table.get(name)
        stale = peer is None or (decode and peer.get("role") not in ("decode", "both"))
        if stale and self.refresh is not None:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the router unreachable: the table stays as it was
                log.warning("peer table refresh failed: %s", e)
        return self.table.get(name)

    def link(self, peer: dict, dst_cluster: str, shm_base: int | None):
        """The link to an instance's KV server (`peer`: its entry in the router's peer table): device pulls
        when both ends take them (transfer.device_transfer; through CUDA IPC when both run on one GPU and
        share its memory, transfer.cuda_ipc), else shared memory when it runs on this host
        (transfer.shared_memory), else TCP; a configured link between the two clusters sets its emulated
        bandwidth, latency, loss and connection count (and always means TCP). Links idle for
        transfer.link_idle_s are closed (their threads end); a later transfer builds a fresh one.
        -> (link, shm region base)"""
        from jaxserve.transfer.link import LinkEmulation
        from jaxserve.transfer.pull import PullLink
        from jaxserve.transfer.shm import ShmLink, same_host
        from jaxserve.transfer.tcp import TcpLink
        t = self.cfg.transfer
        address = peer["kv_address"]
        lk = self.cfg.link(self.cluster, dst_cluster)
        pull = self._pulls(peer, lk)
        ipc = pull and self.pull_server.ipc is not None and peer.get("ipc") == self.pull_server.ipc.key
        shm = peer.get("shm") if t.shared_memory and lk is None and not pull and shm_base is not None else None
        if shm is not None and not same_host(shm.get("boot")):
            shm = None
        key = (address[0], int(address[1]), shm["name"] if shm else None, pull, ipc)
        now = time.monotonic()
        for k, (link, used) in list(self.links.items()):
            if k != key and now - used > t.link_idle_s:
                del self.links[k]
                link.close()
        if key not in self.links:
            kind = " (shm)" if shm else " (cuda ipc)" if ipc else " (device)" if pull else ""
            kw = dict(name=f"{self.inst.name}->{key[0]}:{key[1]}{kind}",
                      chunk_bytes=int(t.chunk_mb * (1 << 20)), timeouts=t.timeouts(), tls=self.client_tls)
            if pull:
                link = PullLink(key[:2], t.token, self.pull_server, t.deadline_s, ipc=ipc, connections=t.connections,
                                **kw)
            elif shm is not None:
                link = ShmLink(key[:2], t.token, shm["name"], connections=t.connections, **kw)
            else:
                gbps = self.link_bandwidth.get(dst_cluster, lk.bandwidth_gbps) if lk else None
                emu = LinkEmulation(gbps, lk.latency_ms, lk.loss) if lk else None
                link = TcpLink(key[:2], t.token, lk.connections if lk else t.connections, emulation=emu, **kw)
            link.metrics.labels = {"src": self.cluster, "dst": dst_cluster}  # the router sums per cluster pair
            self.links[key] = (link, now)
        link = self.links[key][0]
        self.links[key] = (link, now)
        return link, (shm_base if shm else None)

    def _pulls(self, peer: dict, lk) -> bool:
        return lk is None and self.pull_server is not None and bool(peer.get("pull"))

    def _cluster_of(self, instance: str) -> str:
        return self.cfg.cluster_of(instance) if instance in self._names else self.cluster

    def link_to(self, peer: dict, dst):
        """(link, shm region base) for a reservation on instance dst.instance (`peer`: its peer-table entry)."""
        return self.link(peer, self._cluster_of(dst.instance), dst.shm_base)

    def pulls(self, peer: dict, instance: str) -> bool:
        """Whether the link to `instance` (`peer`: its peer-table entry) will pull device arrays (a PullLink), as
        `link` decides before any reservation is known."""
        return self._pulls(peer, self.cfg.link(self.cluster, self._cluster_of(instance)))

    def set_bandwidth(self, dst: str, gbps: float) -> int:
        """SetLink: the emulated bandwidth of the links to cluster dst, now and for links built later -> how
        many open links changed."""
        self.link_bandwidth[dst] = gbps
        changed = 0
        for link, _ in list(self.links.values()):
            if link.metrics.labels.get("dst") == dst and link.shaper.bucket is not None:
                link.set_bandwidth(gbps)
                changed += 1
        return changed

    def snapshots(self) -> dict:
        """Each open link's traffic (transfer/link.py), for the heartbeat."""
        return {v.metrics.name: v.metrics.snapshot() for v, _ in list(self.links.values())}

    def check_peer(self, peer: dict | None, instance: str, field: str = "dst.instance",
                   decode: bool = True) -> str | None:
        """Why KV cannot go to `instance` (None: it can): it must be a registered instance (a decode instance,
        for a request's KV) with a KV server."""
        if peer is None:
            return (f"{field}: {instance!r} is not an instance registered with the router"
                    + ("" if self.refresh is not None else " (this worker has no router: start it with --router)"))
        if decode and peer.get("role") not in ("decode", "both"):
            return f"{field}: {instance!r} is a {peer.get('role')} instance, not a decode instance"
        if not peer.get("kv_address"):
            return f"{field}: {instance!r} has no KV server"
        return None

    def check_dst(self, peer: dict | None, dst, kv: int, layout, dtype_name: str, decode: bool = True) -> str | None:
        """Why a reservation cannot be sent to (None: it can): the instance as check_peer says, its blocks must
        cover the KV, and a shared-memory region must lie page aligned inside the instance's segment, with exactly
        the room the transfer's staging takes."""
        from jaxserve.transfer.bufpool import PAGE
        from jaxserve.transfer.receiver import region_bytes
        why = self.check_peer(peer, dst.instance, decode=decode)
        if why is not None:
            return why
        n = -(-kv // layout.block_size)
        if len(dst.blocks) < n or dst.skip > n:
            return f"dst.blocks: {len(dst.blocks)} blocks (skipping {dst.skip}) do not hold {kv} tokens ({n} blocks)"
        if dst.shm_base is not None and not peer.get("shm"):
            return f"dst.shm_base: {dst.instance!r} has no shared-memory receive pool"
        if dst.shm_base is not None:
            need = region_bytes(layout, dtype_name, kv, dst.skip)
            if dst.shm_base % PAGE or dst.shm_base + need > int(peer["shm"]["bytes"]):
                return (f"dst.shm_base: a region of {need} bytes at {dst.shm_base} is not a page-aligned region "
                        f"of {dst.instance!r}'s receive pool ({peer['shm']['bytes']} bytes)")
        return None

    def close(self) -> None:
        for link, _ in self.links.values():
            link.close()


async def sent(sender, ctx, deadline_s: float) -> dict:
    """Wait until the receiver acknowledged every byte (ABORTED when the transfer failed or outlived
    deadline_s) -> the transfer's numbers."""
    import grpc
    from jaxserve.transfer.pull import PullLink
    from jaxserve.transfer.state import KVPoll
    try:
        state = await sender.state.wait_async(deadline_s)
    except asyncio.CancelledError:
        sender.abort("the caller went away")
        raise
    if state is not KVPoll.DONE:
        sender.abort("deadline passed" if not sender.state.final else sender.state.reason)
        await ctx.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {sender.state.reason}")
    return {"kv_bytes": sender.bytes_acked, "frames": sender.frames, "sends": sender.sends,
            "resends": sender.resends, "backend": ("cuda_ipc" if sender.link.ipc else "device")
            if isinstance(sender.link, PullLink) else "shm" if sender.shm_base is not None else "tcp"}
