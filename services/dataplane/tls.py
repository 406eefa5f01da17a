"""Mutual TLS on the expert workers' gRPC port and TCP data plane, keyed by the cluster's data-plane
secret.

Every process of a cluster already holds its secret (services/dataplane/auth.py). From it each one
derives the same TLS identity: a P-256 key (the scalar from scrypt of the secret: the certificate
is public, so a guessable secret must not be cheap to test against it) and a
self-signed certificate for the name EXPERT_NAME, signed with deterministic ECDSA (RFC 6979) over
fixed fields, so every process builds the same bytes without sending any of them anywhere.
Both ends present that certificate and trust only it: expert workers serve with it and require
it of every client (a client certificate signed by the cluster's key), clients check it and its
name. So a stranger (no secret, hence no key) is refused in the TLS handshake, before a byte of
any request is read (gRPC reads and parses a message of up to 256 MiB before its metadata's
secret can be checked: without mutual TLS a stranger could make a worker buffer that much per
call); on the wire between nodes the traffic and the secret itself are encrypted; only a holder of
the secret can serve as an expert worker. The secret in each call's metadata (auth.py) stays as a
second lock.

A secret of None (a worker started by hand or by a test without one) means plaintext, as before.
Shared memory between processes of one node does not use TLS (it never leaves the machine).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import ssl
import tempfile
from typing import NamedTuple

import grpc

EXPERT_NAME = "moe-cluster-expert"  # the certificate's name; clients check it, not the address
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class TlsIdentity(NamedTuple):
    key_pem: bytes
    cert_pem: bytes


@functools.lru_cache(maxsize=4)
def identity(secret: str) -> TlsIdentity:
    """The cluster's TLS key and certificate, the same in every process given the same secret."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    seed = hashlib.scrypt(secret.encode(), salt=b"moe-cluster expert tls", n=2**14, r=8, p=1, dklen=32)
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, EXPERT_NAME)])
    start = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(seed[:8], "big") >> 1)
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=100 * 365))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(EXPERT_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    return TlsIdentity(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        cert.public_bytes(serialization.Encoding.PEM),
    )


def add_port(server: grpc.Server, address: str, secret: str | None) -> int:
    """Bind `address` on `server`: mutual TLS with the cluster's identity when there is a secret
    (a client without the cluster's certificate fails the handshake)."""
    if secret is None:
        return server.add_insecure_port(address)
    key, cert = identity(secret)
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=cert, require_client_auth=True)
    return server.add_secure_port(address, credentials)


def channel(
    address: str, secret: str | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A channel to an expert worker: mutual TLS (it presents the cluster's certificate, trusts only
    that one and checks its name) when there is a secret, else plaintext."""
    if secret is None:
        return grpc.insecure_channel(address, options=options)
    key, cert = identity(secret)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=cert, private_key=key, certificate_chain=cert
    )
    return grpc.secure_channel(
        address, credentials, options=[*(options or []), ("grpc.ssl_target_name_override", EXPERT_NAME)]
    )


def ssl_context(secret: str, server_side: bool) -> ssl.SSLContext:
    """TLS 1.3 both ways for the TCP data plane: the cluster's certificate presented, the peer's
    required and trusted only if it is the cluster's (a client also checks the name, EXPERT_NAME).
    load_cert_chain reads a file: an anonymous memfd (never on disk), else a private temporary
    file removed at once."""
    key, cert = identity(secret)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert.decode())
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("moe-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, key + cert)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return ctx
    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as f:  # (0600)
        f.write(key + cert)
        f.flush()
        ctx.load_cert_chain(f.name)
    return ctx
