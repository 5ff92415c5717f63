"""A development CA and one certificate per role: `pddjax certs DIR` and `pddjax up --tls`.

Writes the layout serving/security.py reads:
  ca.pem                          the CA certificate (what clients of the router need, and nothing else)
  prefill.pem, prefill-key.pem    one certificate and key per role: relay, main, router likewise
Each role's certificate carries its role as its only URI SAN, the SPIFFE ID
spiffe://pddjax/role/<role> (what grpc reports as `peer_spiffe_id`; serving/authz.py reads it),
plus the DNS names and IP addresses the services are reached at (`hosts`; default localhost and
127.0.0.1), so ordinary hostname verification works. ECDSA P-256, SHA-256. The CA's key is not
written: to add a role or a host, make a new directory (every certificate is reissued).
Built on `cryptography` (trustme cannot put URI SANs in a certificate).
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from serving.security import ROLES, SPIFFE_PREFIX, cert_file, key_file

DEFAULT_HOSTS = ("localhost", "127.0.0.1")


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pddjax"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class DevCA:
    """An in-memory CA that issues role certificates: `issue(role)` -> (cert PEM, key PEM).
    `role=None` issues a certificate of this CA that names no role (tests)."""

    def __init__(self, days: int = 30):
        self.days, self.key = days, ec.generate_private_key(ec.SECP256R1())
        self.name = _name("pddjax development CA")
        self.cert = (_builder(self.name, self.name, self.key.public_key(), days)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(_usage(ca=True), critical=True).sign(self.key, hashes.SHA256()))
        self.cert_pem = _pem(self.cert)

    def issue(self, role: str | None, hosts=DEFAULT_HOSTS) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        names = ([x509.UniformResourceIdentifier(SPIFFE_PREFIX + role)] if role else []) + [_san(h) for h in hosts]
        cert = (_builder(_name(f"pddjax {role or 'no role'}"), self.name, key.public_key(), self.days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_usage(ca=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return _pem(cert), key_pem


def make_dev_certs(directory: str, hosts=DEFAULT_HOSTS, days: int = 30, ca: DevCA | None = None) -> list[str]:
    """ca.pem and every role's certificate and key into `directory` (created; it must not hold
    certificates already), issued by `ca` (default: a new one). Keys are written mode 0600.
    -> the files written."""
    os.makedirs(directory, exist_ok=True)
    taken = [f for f in ("ca.pem", *(cert_file(r) for r in ROLES)) if os.path.exists(os.path.join(directory, f))]
    if taken:
        raise FileExistsError(f"{directory} already holds {taken[0]}; make the certificates in an empty directory")
    ca, written = ca or DevCA(days), []

    def write(name: str, data: bytes, mode: int) -> None:
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        written.append(path)

    write("ca.pem", ca.cert_pem, 0o644)
    for role in ROLES:
        cert, key = ca.issue(role, hosts)
        write(cert_file(role), cert, 0o644)
        write(key_file(role), key, 0o600)
    return written
