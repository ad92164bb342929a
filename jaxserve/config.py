"""Cluster / server configuration: YAML validated by pydantic, frozen, unknown keys rejected.

Errors name the file and the field (`ConfigFileError: configs/x.yaml: engine.block_size: ...`). Presets live
in `configs/`; `configs/local.yaml` is also embedded in the package as the default.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine.settings import DEFAULTS as ENGINE
from .policy_config import BY_NAME, LeastLoadedPolicy, PolicyKeyError, PolicySection, check_keys



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    path: str = Field("bundled", description="checkpoint directory, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct, "
                      "GGUF) or 'bundled' (a small random Kimi Linear)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the weights' and KV cache's dtype; auto: float32 on a CPU (there a bfloat16 cache's "
                            "every write converts the whole cache to float32 and back), bfloat16 on an accelerator, "
                            "each instance by its own device (a cluster of CPU and GPU instances names one: KV moves "
                            "only between equal dtypes)")
    name: str | None = Field(None, description="served model name (default: the directory name)")


class EngineSection(_Strict):
    block_size: int = Field(ENGINE["block_size"], ge=1, le=1024, description="tokens per KV cache block")
    num_blocks: int | None = Field(ENGINE["num_blocks"], ge=1, description="KV cache blocks in the pool "
        "(full-attention layers; default: as many as memory_fraction leaves after the weights and activations, logged "
        "at start-up)")
    memory_fraction: float | None = Field(ENGINE["memory_fraction"], gt=0, le=1, description="the memory the default "
        "cache is sized from: the share of each accelerator's memory the instance may take, weights, activations and "
        "cache (as vLLM's gpu_memory_utilization; default 0.9), or on a CPU the share of the host's memory the cache "
        "takes (default 0.05)")
    max_num_seqs: int | None = Field(ENGINE["max_num_seqs"], ge=1, description="concurrent requests (default: as many "
        "as the cache holds at 256 tokens each, 8 to 256)")
    max_num_batched_tokens: int | None = Field(ENGINE["max_num_batched_tokens"], ge=1, description="tokens one "
        "engine step runs, prefill and decode together (default: 1024 on a CPU, where a step's time follows its "
        "tokens; 2048 on an accelerator, where a smaller step is bound by its weight reads)")
    mixed_batched_tokens: int | None = Field(ENGINE["mixed_batched_tokens"], ge=1, description="prefill tokens in a "
        "step that also decodes: the running requests wait for that step's prefill, so this bounds the gap between "
        "their tokens (default: max_num_batched_tokens)")
    chunk_size: int | None = Field(ENGINE["chunk_size"], ge=1, description="prefill tokens per request per step, a "
        "multiple of block_size (default: max_num_batched_tokens where the model prefills over the paged cache in one "
        "packed program, every full-attention GQA model on the native CPU kernels, or with its prefill kernels "
        "compiled, the Pallas kernels on a GPU; 256 otherwise)")
    max_prefill_seqs: int = Field(ENGINE["max_prefill_seqs"], ge=1, description="first chunks one prefill step takes "
        "where the model's prefill programs are dense [rows, chunk] shapes: packed into one program where every layer "
        "is GQA attention, a program each otherwise")
    max_model_len: int | None = Field(ENGINE["max_model_len"], ge=1, description="the longest prompt + output "
        "(default: the model's context, capped by what the pool holds)")
    prefix_caching: bool = Field(ENGINE["prefix_caching"], description="reuse the KV of full prompt blocks seen before "
        "(chain hashes)")
    num_snapshots: int = Field(ENGINE["num_snapshots"], ge=0, description="request-level state snapshots (linear and "
        "sliding-window layers) kept for prefix reuse")
    kernels: Literal["auto", "reference", "pallas", "interpret", "native"] = Field(ENGINE["kernels"], description=(
        "Pallas kernels (GPU), native C++ kernels (CPU) or jnp references; auto: pallas on a GPU, native elsewhere, "
        "each kernel the model uses checked against its reference at start-up and one that fails run as the reference; "
        "pallas, native: such a kernel stops the start"))
    overlap: bool | None = Field(ENGINE["overlap"], description="while the device runs a steady decode step, "
        "dispatch the next one before reading its tokens (asynchronous scheduling: a request's extra token after its "
        "end is dropped; a request that arrives meanwhile waits for the step dispatched ahead); false: every step "
        "waits for its tokens (default: on an accelerator, off on a CPU, whose cores run both the step and the host's "
        "work)")
    scan_layers: bool | None = Field(ENGINE["scan_layers"], description="run each run of identical layers as one "
        "lax.scan: its layer compiled once, so programs compile in a fraction of the time and the layer groups of a "
        "layer-wise prefill share programs (default: on with the CPU kernels, and on an accelerator for prefill "
        "instances, whose start waits on compiling; off elsewhere on an accelerator, where decode steps run their "
        "layers unrolled)")
    packed_prefill: bool | None = Field(ENGINE["packed_prefill"], description="prefill a model of full-attention "
        "GQA layers only in one packed program per step over the paged cache, a step's decode tokens in it too (the "
        "weights read once for both; one program per token bucket); default: with the native CPU kernels; true: with "
        "the Pallas kernels too (their paged prefill kernel for first chunks, not flash attention)")
    warmup: bool = Field(True, description="compile the decode programs before serving")
    compilation_cache: str | None = Field(ENGINE["compilation_cache"], description="XLA's persistent compilation cache "
        "directory: a restart compiles nothing it compiled before, and the kernel self-test's passes are kept there "
        "(null: off; JAX_COMPILATION_CACHE_DIR, when set, wins)")

    @model_validator(mode="after")
    def _chunk(self):
        if self.chunk_size is not None and self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a multiple of block_size ({self.block_size})")
        return self

    def engine_config(self, max_waiting: int):
        """The engine's EngineConfig (engine/settings.py, whose defaults these keys have)."""
        from .engine.settings import EngineConfig
        d = self.model_dump()
        d.pop("warmup")
        return EngineConfig(max_waiting=max_waiting, **d)


class InstanceSection(_Strict):
    name: str = Field(description="unique in the config: workers, the router's logs and /health use it")
    role: Literal["prefill", "decode", "both", "store"] = Field("both", description="store: the global KV cache "
                                                                "store (prefix KV shared by every prefill instance)")
    kv_blocks: int | None = Field(None, ge=1, description="cache blocks of this instance (default engine.num_blocks): "
                                  "a store's capacity")
    spill_mb: int | None = Field(None, ge=1, description="store: blocks evicted from its cache go to disk, up to "
                                 "this many MB, and stay in the store (cache/disk_tier.py)")
    spill_dir: str | None = Field(None, description="store: where spilled blocks go (default "
                                  "~/.cache/jaxserve/spill/<instance>; emptied at start)")
    devices: list[int] = Field(default_factory=lambda: [0], description="the devices of each of its hosts")
    device_memory: float | None = Field(None, gt=0, le=1, description="the share of each of its devices' memory its "
                                        "process may take (XLA_PYTHON_CLIENT_MEM_FRACTION; the KV cache is sized "
                                        "inside it, engine.memory_fraction); default: 0.9 split evenly between the "
                                        "launched instances on this machine (host loopback) that share a device, "
                                        "JAX's own default (0.75) for an instance alone on its devices")
    tp: int = Field(1, ge=1, description="tensor parallelism over all its hosts' devices")
    hosts: int = Field(1, ge=1, description="processes (one per host) forming this instance: one JAX multi-controller "
                       "program, its mesh over every process's devices (worker/group.py); tp / hosts devices each")
    group_port: int = Field(0, ge=0, le=65534, description="hosts > 1: the port the first process serves "
                            "jax.distributed's coordinator on; the port after it carries its step broadcast "
                            "(0: the local launcher picks free ports, Kubernetes uses 8476)")
    cpus: list[int] = Field(default_factory=list, description="CPU cores the worker is pinned to (empty: all)")
    host: str = Field("127.0.0.1", description="address the worker's gRPC and KV servers listen on")
    port: int = Field(0, ge=0, le=65535, description="gRPC control port (0: any free port)")
    kv_port: int = Field(0, ge=0, le=65535, description="KV data port: where KV sent to this instance arrives "
                         "(0: any free port)")
    kv_advertise: str | None = Field(None, description="host:port other instances dial for this instance's "
                                     "KV data (a NAT, load balancer or proxy in front of it); "
                                     "default: host and the bound kv_port")
    launch: bool = Field(True, description="`jaxserve serve` starts this worker as a child process; false: it "
                                           "joins from another host (`jaxserve worker ... --router HOST:PORT`)")
    standby: bool = Field(False, description="not started with the cluster: the flowkv controller starts it when "
                          "its role needs one instance more (scale-out) and stops it again (scale-in)")

    @model_validator(mode="after")
    def _devices(self):
        if self.kv_advertise is not None:
            host, _, port = self.kv_advertise.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"kv_advertise must be host:port, got {self.kv_advertise!r}")
        if self.tp % self.hosts:
            raise ValueError(f"hosts: {self.hosts} hosts cannot share tp={self.tp} devices evenly")
        if len(self.devices) < self.tp // self.hosts:
            raise ValueError(f"tp={self.tp} needs {self.tp // self.hosts} devices per host, {len(self.devices)} "
                             "listed")
        if self.hosts > 1 and (self.role == "store" or self.standby):
            raise ValueError("hosts: a store runs no model step and a standby instance is one process; either "
                             "runs on one host")
        if self.standby and (not self.launch or self.role == "store"):
            raise ValueError("standby: a standby instance is started by the router (launch: true), and is no store")
        if (self.spill_mb is not None or self.spill_dir is not None) and self.role != "store":
            raise ValueError("spill_mb: only the global KV store (role: store) spills its cache to disk")
        if self.spill_dir is not None and self.spill_mb is None:
            raise ValueError("spill_dir needs spill_mb (the disk tier's size)")
        return self

    def spill_path(self) -> str | None:
        """The disk tier's directory (None: no disk tier)."""
        if self.spill_mb is None:
            return None
        return self.spill_dir or os.path.join("~/.cache/jaxserve/spill", self.name)


class ClusterSection(_Strict):
    name: str = Field(description="the cluster's name (links name their ends by it)")
    kind: Literal["pd", "prfaas"] = Field("pd", description="pd: prefill and decode instances; prfaas: prefill "
                                          "instances only, whose KV goes to a pd cluster's decode instances")
    instances: list[InstanceSection] = Field(min_length=1, description="its instances, at least one")


class LinkSection(_Strict):
    """The network from cluster `src`'s prefill instances to cluster `dst`'s decode instances (src == dst: inside
    one cluster). The TCP backend enforces bandwidth (token bucket), latency and loss, so a cross-datacenter
    link can be modelled on one machine."""
    src: str = Field(description="the cluster whose prefill instances send")
    dst: str = Field(description="the cluster whose decode instances receive")
    bandwidth_gbps: float = Field(10.0, gt=0, description="emulated bandwidth, Gbit/s (a token bucket)")
    latency_ms: float = Field(0.0, ge=0, description="emulated one-way latency")
    loss: float = Field(0.0, ge=0, lt=1, description="emulated loss: the fraction of frames that arrive corrupted "
                        "and are sent again")
    connections: int = Field(4, ge=1, description="parallel TCP connections of each of its links")


class TlsSection(_Strict):
    """TLS on the control plane (gRPC: router <-> workers) and the KV links (TCP; shared memory and device pulls
    keep TCP only for their small control frames, which then go over TLS too). Every process uses the same CA;
    each server's certificate must name the host peers dial it at. `jaxserve certs` writes a CA and
    certificates."""
    ca_file: str = Field(description="PEM file of the cluster CA every certificate must chain to")
    cert_file: str = Field(description="PEM file of this process's certificate")
    key_file: str = Field(description="PEM file of its private key")
    mutual: bool = Field(False, description="servers also require a client certificate signed by the CA")

    @model_validator(mode="after")
    def _files(self):
        for name in ("ca_file", "cert_file", "key_file"):
            if not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name}: no such file {getattr(self, name)!r}")
        return self

    def build(self):
        from jaxserve.transfer.tls import Tls
        return Tls(self.ca_file, self.cert_file, self.key_file, self.mutual)


class TransferSection(_Strict):
    token: str = Field("jaxserve-local", description="cluster token every KV data connection must present")
    token_file: str | None = Field(None, description="read the cluster token from this file instead (a mounted "
                                   "Kubernetes Secret); its content replaces `token` when the config is loaded")
    connections: int = Field(4, ge=1, description="parallel TCP connections per link")
    chunk_mb: float = Field(64.0, gt=0, description="largest frame payload (a send is split into one frame per "
                            "connection, of at least 1 MiB, at most this)")
    layers_per_group: int | None = Field(None, ge=1, description="prefill streams KV every this many layers")
    stream_min_tokens: int = Field(512, ge=0, description="with layers_per_group: a transfer of fewer tokens goes "
                                   "out in one group after the prefill step (for a short prompt the per-group "
                                   "programs cost more than its KV takes to send)")
    deadline_s: float = Field(30.0, gt=0, description="decode frees a reservation whose KV has not arrived by then")
    recv_pool_mb: int = Field(256, ge=1, description="receive pool of a decode instance")
    leave_last_token: bool = Field(False, description="prefill leaves the last prompt token for decode to compute")
    shared_memory: bool = Field(True, description="prefill on the decode instance's host writes KV straight into "
                                                  "its receive pool (shared memory) instead of over TCP; a global KV "
                                                  "store keeps its pool in shared memory, read in place by prefill "
                                                  "instances on its host")
    io_timeout_s: float = Field(10.0, gt=0, description="a KV socket read or write that makes no progress for this "
                                "long fails (and TCP_USER_TIMEOUT): a silent partition breaks the connection")
    idle_timeout_s: float = Field(300.0, gt=0, description="a KV server closes a connection idle for this long")
    link_idle_s: float = Field(120.0, gt=0, description="a prefill worker closes a link to a decode instance "
                               "unused for this long (its threads end; the next transfer builds a fresh one)")
    tls: TlsSection | None = Field(None, description="TLS (optionally mutual) on gRPC and the KV links; "
                                   "none: plaintext, the cluster token still required")
    device_transfer: Literal["auto", "on", "off"] = Field(
        "auto", description="decode pulls KV device to device through JAX's transfer server (jax.experimental."
                            "transfer) when both ends enable it; auto: on where JAX runs on a GPU or TPU")
    cuda_ipc: bool = Field(True, description="with device transfers, instances sharing one GPU move KV through CUDA "
                           "IPC: decode copies the arrays out of prefill's device memory (a device-to-device copy) "
                           "instead of taking them over the transfer server's sockets")

    @model_validator(mode="before")
    @classmethod
    def _token_file(cls, data):
        path = data.get("token_file") if isinstance(data, dict) else None
        if not isinstance(path, str):
            return data  # absent (or the wrong type: the field's own check says so)
        if "token" in data:
            raise ValueError("token_file: give the token or the file it is in, not both")
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"token_file: cannot read {path!r}: {e.strerror}") from None
        if not token:
            raise ValueError(f"token_file: {path!r} is empty")
        return {**data, "token": token}

    def groups_of(self, kv_tokens: int) -> int | None:
        """Layers per group of a transfer of `kv_tokens` tokens (None: one group, sent after the step)."""
        return self.layers_per_group if kv_tokens >= self.stream_min_tokens else None

    def timeouts(self):
        """The KV sockets' timeouts and limits (transfer/net.py); a frame unacknowledged past the transfer
        deadline means its connection is gone."""
        from jaxserve.transfer.net import Timeouts
        return Timeouts(io_s=self.io_timeout_s, idle_s=self.idle_timeout_s, ack_s=self.deadline_s + self.io_timeout_s)

    def pulls(self, platform: str) -> bool:
        """Whether an instance whose JAX platform is `platform` uses the device backend."""
        return self.device_transfer == "on" or (self.device_transfer == "auto" and platform != "cpu")


class RouterSection(_Strict):
    host: str = Field("127.0.0.1", description="address of the router's control port (worker registration)")
    port: int = Field(0, ge=0, le=65535, description="control port (0: any free port)")
    heartbeat_s: float = Field(1.0, gt=0, description="workers re-register this often")
    down_after_s: float = Field(5.0, gt=0, description="a worker not heard from for this long is down")
    ready_timeout_s: float = Field(900.0, gt=0, description="how long serve waits for its workers to register")
    max_attempts: int = Field(3, ge=1, description="tries per request (prefill or decode failures retry)")
    busy_wait_s: float = Field(30.0, ge=0, description="how long a request waits for a decode instance with room")
    local_fallback: bool = Field(True, description="with no prefill instance left, run the request whole on "
                                                   "one instance rather than failing it")
    early_prefill: bool = Field(True, description="send a request's Prefill call beside its Decode call, so the "
                                "prefill starts while decode reserves (its KV waits for the reservation); off, or "
                                "where decode holds a cached prefix of the prompt or a store load or write-back is "
                                "planned, the Prefill call follows the reservation")
    role_change_timeout_s: float = Field(600.0, gt=0, description="how long a role change may take (the instance "
                                         "drains what it has in flight, then compiles its new role's programs)")
    store_write: Literal["streamed", "after"] = Field(
        "streamed", description="how a prompt's KV reaches the global KV store: streamed (each layer group as the "
        "prefill computes it, beside decode's: BanaServe's pipeline; on CPUs its copy shares the prefill's cores "
        "and time) or after (copied from the prefill instance once its prefill is done)")

    @model_validator(mode="after")
    def _beat(self):
        if self.down_after_s <= self.heartbeat_s:
            raise ValueError(f"down_after_s ({self.down_after_s}) must exceed heartbeat_s ({self.heartbeat_s})")
        return self


class ServerSection(_Strict):
    host: str = Field("127.0.0.1", description="address the HTTP server listens on")
    port: int = Field(8000, ge=0, le=65535, description="the HTTP port (the OpenAI API, /health, /metrics)")
    api_keys: list[str] = Field(default_factory=list, description="keys a client must send as `Authorization: "
                                "Bearer KEY` (empty: none needed)")
    max_waiting: int = Field(ENGINE["max_waiting"], ge=1, description="queued requests beyond the free decode "
                             "slots from which new ones get 429 (the engine's max_waiting)")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(8, ge=1, description="the largest n (choices per request)")
    request_timeout_s: float = Field(600.0, gt=0, description="a request not done by then ends with 408")
    keep_alive_s: float = Field(75.0, gt=0, description="how long an idle client connection stays open; keep it "
                                "above the idle timeout of any client pool or proxy in front (a request sent on a "
                                "connection the server is closing fails with a connection reset)")
    profile_dir: str = Field("profiles", description="where POST /debug/profile writes its traces")
    max_request_mb: float = Field(8.0, gt=0, description="largest request body; larger ones get 413 before they "
                                  "are read")
    rate_limit_rps: float | None = Field(None, gt=0, description="requests per second per API key (per client "
                                         "address without keys); over it: 429 with Retry-After. None: no limit")
    rate_limit_burst: int = Field(10, ge=1, description="requests a key may send at once before rate_limit_rps "
                                  "applies")
    json_whitespace: Literal["compact", "flexible"] = Field(
        "compact", description="whitespace in JSON answers to a schema: compact (none: `,` and `:` between "
        "items), or flexible (any JSON whitespace anywhere: a small model may fill it with newlines); a schema's own "
        "`x-guidance` options win (jaxserve/schema.py)")
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="how tool calls are found in a chat answer with tool_choice auto "
        "(server/tools.py): hermes `<tool_call>{...}</tool_call>` blocks, or llama3_json (the answer one JSON call)")


SHARED_DEVICES = 0.9  # of a device the launched instances sharing it take by default, split evenly
MIN_DEVICE_SHARE = 0.02


class Config(_Strict):
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    clusters: list[ClusterSection] = Field(
        default_factory=lambda: [ClusterSection(name="local", instances=[InstanceSection(name="local-0")])])
    links: list[LinkSection] = Field(default_factory=list)
    transfer: TransferSection = Field(default_factory=TransferSection)
    router: RouterSection = Field(default_factory=RouterSection)
    policy: PolicySection = Field(default_factory=LeastLoadedPolicy)
    server: ServerSection = Field(default_factory=ServerSection)

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_keys(cls, data):
        return check_keys(data)

    @model_validator(mode="after")
    def _names(self):
        names = [i.name for c in self.clusters for i in c.instances]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"instance names must be unique: {sorted(dup)}")
        if not any(i.role in ("decode", "both") for c in self.clusters for i in c.instances):
            raise ValueError("clusters: no instance can decode (every instance has role 'prefill')")
        stores = [i.name for c in self.clusters for i in c.instances if i.role == "store"]
        if len(stores) > 1:
            raise ValueError(f"clusters: one instance of role 'store' at most, got {stores}")
        for c in self.clusters:
            wrong = [i.name for i in c.instances if i.role != "prefill"]
            if c.kind == "prfaas" and wrong:
                raise ValueError(f"clusters[{c.name}]: a prfaas cluster holds prefill instances only; "
                                 f"{wrong} have another role")
        clusters = {c.name for c in self.clusters}
        if len(clusters) != len(self.clusters):
            raise ValueError(f"cluster names must be unique: {[c.name for c in self.clusters]}")
        for link in self.links:
            for end in (link.src, link.dst):
                if end not in clusters:
                    raise ValueError(f"link end {end!r} is not a cluster ({sorted(clusters)})")
        for i in self.instances():
            share = self.device_share(i.name)  # raises where the instances sharing a device ask for too much
            if share is not None and share < MIN_DEVICE_SHARE:
                raise ValueError(f"clusters.instances[{i.name}].device_memory: {share:.3f} of its devices is left for "
                                 f"it beside the instances it shares them with; give each a device_memory")
        return self

    def sharing(self, name: str) -> list[InstanceSection]:
        """The launched instances on this machine (loopback host) that share a device with `name` (itself
        included; just itself when it is alone, or not on this machine)."""
        me = self.instance(name)
        if not (me.launch and _loopback(me.host)):
            return [me]
        return [i for i in self.instances() if i.name == name or
                (i.launch and _loopback(i.host) and set(i.devices) & set(me.devices))]

    def device_share(self, name: str) -> float | None:
        """The share of its devices' memory instance `name`'s process may take (its `device_memory`; default:
        SHARED_DEVICES split evenly between the instances sharing them, None for one alone: JAX's default).
        Raises ValueError naming the field when those instances' explicit shares exceed the device."""
        me, group = self.instance(name), self.sharing(name)
        fixed = [i.device_memory for i in group if i.device_memory is not None]
        if sum(fixed) > 1 + 1e-9:
            raise ValueError(f"clusters.instances[{name}].device_memory: the instances sharing its devices "
                             f"({[i.name for i in group]}) take {sum(fixed):g} of them, more than all")
        if me.device_memory is not None or len(group) == 1:
            return me.device_memory
        return max(0.0, SHARED_DEVICES - sum(fixed)) / (len(group) - len(fixed))

    @property
    def disaggregated(self) -> bool:
        """Served through the router and worker processes (anything but one colocated instance)."""
        insts = self.instances()
        return not (len(insts) == 1 and insts[0].role == "both" and insts[0].launch)

    def check_exposure(self) -> None:
        """Refuse (ConfigFileError naming the field) to serve the control or KV plane on an address that is not
        loopback while the cluster token is a default anyone can read in this repository."""
        if self.transfer.token not in DEFAULT_TOKENS:
            return
        exposed = ([f"router.host: {self.router.host}"] if self.disaggregated and not _loopback(self.router.host)
                   else [])
        exposed += [f"clusters.instances[{i.name}].host: {i.host}" for i in self.instances()
                    if self.disaggregated and not _loopback(i.host)]
        if exposed:
            raise ConfigFileError(f"transfer.token: the default token {self.transfer.token!r} with a non-loopback "
                                  f"address ({'; '.join(exposed)}): anyone who reads this repository could join the "
                                  f"cluster; set transfer.token to a secret of your own")

    def instances(self) -> list[InstanceSection]:
        return [i for c in self.clusters for i in c.instances]

    def cluster_of(self, name: str) -> str:
        for c in self.clusters:
            if any(i.name == name for i in c.instances):
                return c.name
        raise ConfigFileError(f"clusters: no instance named {name!r}")

    def link(self, src: str, dst: str) -> LinkSection | None:
        """The configured link from cluster src to cluster dst, if any."""
        return next((lk for lk in self.links if lk.src == src and lk.dst == dst), None)

    def instance(self, name: str) -> InstanceSection:
        for i in self.instances():
            if i.name == name:
                return i
        raise ConfigFileError(f"clusters: no instance named {name!r} (have {[i.name for i in self.instances()]})")


class ConfigFileError(ValueError):
    pass


DEFAULT_TOKENS = frozenset({"jaxserve-local", "change-me", ""})


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(data, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = [str(x) for x in err["loc"]]
            if loc[:1] == ["policy"] and loc[1:2] and loc[1] in BY_NAME:  # the union's tag: the section's `name`
                del loc[1]
            msg = err["msg"].removeprefix("Value error, ")
            wrong = (err.get("ctx") or {}).get("error")
            if isinstance(wrong, PolicyKeyError):  # a policy section's key: its own place in the path
                loc, msg = loc + [wrong.key], str(wrong)
            lines.append(f"{source}: {'.'.join(loc) or '(top level)'}: {msg}")
        raise ConfigFileError("\n".join(lines)) from None


def load(path: str | None = None) -> Config:
    """A config file, or the embedded `local.yaml` when `path` is None."""
    if path is None:
        text = resources.files("jaxserve").joinpath("configs/local.yaml").read_text()
        return parse(yaml.safe_load(text), "local.yaml (embedded)")
    if not os.path.isfile(path):
        raise ConfigFileError(f"{path}: no such config file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigFileError(f"{path}: not valid YAML: {e}") from None
    return parse(data, path)
