"""TLS for the control plane (gRPC) and the KV link (TCP), optionally mutual (plain Python over `ssl`).

`Tls` names a cluster CA and this process's certificate and key. Every process of a cluster uses the same CA: a
server presents its certificate (which must name the address peers dial it at, as an IP or DNS subjectAltName),
a client verifies it against the CA; with `mutual`, servers also demand a client certificate signed by that CA.
The cluster token is still required on top (it is what the router's peer table and the KV HELLO check).

KV link sockets: the receiver's connection thread both reads and writes its socket, so it uses the SSL socket as
is. A sender connection is shared by a writer thread and a reader thread, and OpenSSL does not allow one SSL
object to be used by two threads at once; `SharedTls` serialises them with a lock, and the reader takes the lock
only once bytes are waiting (select on the socket, or data OpenSSL has already decrypted), so a reader waiting
for an acknowledgement never blocks the writer. Servers send no TLS 1.3 session tickets, so a record that is
not application data never arrives after the handshake for the reader to block on.

`make_certs` writes a CA and certificates for a list of hosts (`jaxserve certs`), with `cryptography`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import select
import socket
import ssl
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Tls:
    ca_file: str  # PEM: the cluster CA every peer's certificate must chain to
    cert_file: str  # PEM: this process's certificate (server and, with mutual, client)
    key_file: str  # PEM: its private key
    mutual: bool = False  # servers require a client certificate signed by the CA

    def __post_init__(self):
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")

    def _read(self, name: str) -> bytes:
        with open(getattr(self, name), "rb") as f:
            return f.read()

    # ---- KV link
    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(self.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.mutual else ssl.CERT_NONE
        ctx.num_tickets = 0  # nothing but application data after the handshake (SharedTls)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server's chain and name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(self.ca_file)
        if self.mutual:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    # ---- gRPC
    def grpc_server_credentials(self):
        import grpc
        return grpc.ssl_server_credentials([(self._read("key_file"), self._read("cert_file"))],
                                           root_certificates=self._read("ca_file"),
                                           require_client_auth=self.mutual)

    def grpc_channel_credentials(self):
        import grpc
        if self.mutual:
            return grpc.ssl_channel_credentials(self._read("ca_file"), self._read("key_file"), self._read("cert_file"))
        return grpc.ssl_channel_credentials(self._read("ca_file"))


def shutdown(sock: socket.socket) -> None:
    """Shut a (possibly SSL) socket down for both directions from any thread, waking a thread blocked in it.
    `SSLSocket.shutdown` drops its SSL object, which a thread still inside a read could then miss."""
    if isinstance(sock, SharedTls):
        sock = sock._sock
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class SharedTls:
    """An SSL socket shared by one writing and one reading thread (a sending link's connection): each SSL call
    under one lock; reads wait for bytes (the socket's timeout) before they take it. Everything else (settimeout,
    getsockopt, fileno, close) goes to the socket."""

    def __init__(self, sock: ssl.SSLSocket):
        self._sock = sock
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendall(self, data) -> None:
        with self._lock:
            self._sock.sendall(data)

    def _wait(self) -> None:
        if self._sock.pending():
            return
        ready, _, _ = select.select([self._sock], [], [], self._sock.gettimeout())
        if not ready:
            raise TimeoutError("timed out")

    def recv(self, n: int) -> bytes:
        self._wait()
        with self._lock:
            return self._sock.recv(n)

    def recv_into(self, buf, n: int = 0) -> int:
        self._wait()
        with self._lock:
            return self._sock.recv_into(buf, n)

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        shutdown(self._sock)


def make_certs(out_dir: str, hosts: list[str], names: list[str] | None = None, days: int = 365) -> dict[str, tuple]:
    """A cluster CA (out_dir/ca.pem, ca-key.pem) and, per name, a certificate valid for every host in `hosts`
    (IP addresses as IP subjectAltNames, others as DNS names): out_dir/<name>.pem and <name>-key.pem.
    -> {name: (cert path, key path)}, and "ca": (ca.pem, ca-key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("make_certs: at least one host")
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def write(path: str, data: bytes, private: bool) -> str:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def save(name: str, cert, key) -> tuple[str, str]:
        pem = cert.public_bytes(serialization.Encoding.PEM)
        kpem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        return (write(os.path.join(out_dir, f"{name}.pem"), pem, False),
                write(os.path.join(out_dir, f"{name}-key.pem"), kpem, True))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxserve cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": save("ca", ca, ca_key)}
    alt = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    for name in names or ["node"]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[name] = save(name, cert, key)
    return out
