"""Helpers for the network tests: throwaway certificates (made with `cryptography`), the addresses a
process listens on, the status code of a failing gRPC call."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(directory: Path, name: str = "tandem-verifier", ips: tuple[str, ...] = ("127.0.0.1",),
                dns: tuple[str, ...] = ()) -> tuple[str, str]:
    """A self-signed server certificate naming `ips` and `dns`; returns (cert_file, key_file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips] + [x509.DNSName(d) for d in dns]
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def listening_hosts(pid: int, port: int) -> set[str]:
    """The addresses process `pid` listens on at `port` (gRPC's dual-stack ::ffff:a.b.c.d read as a.b.c.d)."""
    hosts = set()
    for c in psutil.Process(pid).net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            ip = ipaddress.ip_address(c.laddr.ip)
            hosts.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return hosts


def status_code(call) -> grpc.StatusCode:
    """The status of `call()`, which must fail."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()
