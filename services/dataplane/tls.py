"""TLS on the expert workers' gRPC port, keyed by the cluster's data-plane secret.

Every process of a cluster already holds its secret (services/dataplane/auth.py). From it each one
derives the same TLS identity: a P-256 key (the scalar from scrypt of the secret: the certificate
is public, so a guessable secret must not be cheap to test against it) and a
self-signed certificate for the name EXPERT_NAME, signed with deterministic ECDSA (RFC 6979) over
fixed fields, so every process builds the same bytes without sending any of them anywhere.
Expert workers serve with that key; clients trust only that certificate and check the name. So
on the wire between nodes the traffic and the secret itself are encrypted, only a holder of the
secret can serve as an expert worker, and a client that checks certificates (every gRPC client
does by default) cannot finish a handshake without it; there are no client certificates, so one
that skips the check gets a connection and is then refused by the secret check (auth.py).

A secret of None (a worker started by hand or by a test without one) means plaintext, as before.
Shared memory between processes of one node does not use TLS (it never leaves the machine).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
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
    """Bind `address` on `server`: TLS with the cluster's identity when there is a secret."""
    if secret is None:
        return server.add_insecure_port(address)
    key, cert = identity(secret)
    return server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))


def channel(
    address: str, secret: str | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A channel to an expert worker: TLS trusting only the cluster's certificate (name checked)
    when there is a secret, else plaintext."""
    if secret is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=identity(secret).cert_pem)
    return grpc.secure_channel(
        address, credentials, options=[*(options or []), ("grpc.ssl_target_name_override", EXPERT_NAME)]
    )
