"""Mutual TLS for every gRPC link: a deployment CA, one certificate per component and level.

``strata certs`` makes, in one directory::

    ca.pem  ca.key                       the deployment's CA (keep ca.key off the hosts)
    master-<slug>.pem / .key             the master of a level (server for clients, client of workers)
    worker-<slug>.pem / .key             the workers of a level (server for the master)
    client-<slug>.pem / .key             users' tools logging in at that level

Every certificate names its component and level in the subject
(``O=Strata, OU=<level>, CN=<role>.<slug>.strata``) and carries the DNS name
``<role>.<slug>.strata``.  Two checks enforce levels, one per side of a link:

* the caller pins the name it expects (``grpc.ssl_target_name_override``): a
  master of level S only completes a handshake with a server whose certificate
  says ``worker.S.strata``, a client of level S only with ``master.S.strata``;
* the server reads the caller's certificate (:class:`PeerCheck`, a gRPC server
  interceptor): a worker serves only a ``master`` of its own level, a master
  only ``client`` certificates of its own level.

A process without a certificate of the deployment's CA fails the handshake.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from .groups import level_slug
from .private import private_dir

__all__ = ["ROLES", "Identity", "TlsError", "create_deployment", "issue", "make_ca", "server_credentials",
           "secure_channel", "PeerCheck", "peer_identity", "read_identity", "find_client_level", "has_material",
           "cert_paths", "SCRAPER", "issue_scraper"]

ROLES = ("master", "worker", "client")
#: the role of a level's scraper certificate (``CN=scraper.<level>.strata``, client authentication only): the
#: one certificate a level's workers' /metrics answer (worker/metrics.py); not a component's role
SCRAPER = "scraper"
DOMAIN = "strata"
VALID_DAYS = 825


class TlsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Identity:
    role: str
    level: str


def _slug(level: str) -> str:
    return level_slug(level)


def dns_name(role: str, level: str) -> str:
    return f"{role}.{_slug(level)}.{DOMAIN}".lower()


def cert_paths(tls_dir: Path | str, role: str, level: str) -> tuple[Path, Path]:
    d = Path(tls_dir)
    return d / f"{role}-{_slug(level)}.pem", d / f"{role}-{_slug(level)}.key"


def has_material(tls_dir: Path | str, role: str, level: str) -> bool:
    cert, key = cert_paths(tls_dir, role, level)
    return (Path(tls_dir) / "ca.pem").exists() and cert.exists() and key.exists()


# ---- issuing ---------------------------------------------------------------------------
def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(out: Path | str, name: str = "Strata deployment CA"):
    """Create (or load) ``ca.pem``/``ca.key`` in ``out``; returns (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(out)
    private_dir(out, "certificate directory")  # private keys (0600) and the certificates
    cpath, kpath = out / "ca.pem", out / "ca.key"
    if cpath.exists() and kpath.exists():
        return (x509.load_pem_x509_certificate(cpath.read_bytes()),
                serialization.load_pem_private_key(kpath.read_bytes(), None))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Strata"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(kpath, _key_pem(key))
    cpath.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(out: Path | str, role: str, level: str, hosts: list[str] = (), ca=None) -> tuple[Path, Path]:
    """Issue ``<role>-<slug>.pem/.key`` signed by the CA in ``out``; ``hosts`` are extra DNS names/IPs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if role not in ROLES + (SCRAPER,):
        raise TlsError(f"unknown role {role!r} (roles: {', '.join(ROLES + (SCRAPER,))})")
    ca_cert, ca_key = ca or make_ca(out)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Strata"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, level),
                         x509.NameAttribute(NameOID.COMMON_NAME, dns_name(role, level))])
    names: list[x509.GeneralName] = [x509.DNSName(dns_name(role, level))]
    for h in (() if role == SCRAPER else hosts):  # a scraper is only ever a client
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH] if role == SCRAPER else
                                                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cpath, kpath = cert_paths(out, role, level)
    _write_private(kpath, _key_pem(key))
    cpath.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cpath, kpath


def issue_scraper(tls_dir: Path | str, level: str) -> tuple[Path, Path]:
    """Issue ``scraper-<level>.pem/.key`` in ``tls_dir`` with the CA there (``ca.pem`` and ``ca.key``: run
    where the CA is kept, like ``strata certs``; a missing CA is refused, never made); ``level`` canonical."""
    d = Path(tls_dir)
    if not ((d / "ca.pem").exists() and (d / "ca.key").exists()):
        raise TlsError(f"no CA in {d} (ca.pem and ca.key): issue scraper certificates where `strata certs` made it")
    return issue(d, SCRAPER, level)


def create_deployment(out: Path | str, levels: list[str], hosts: list[str] = (),
                      roles: tuple[str, ...] = ROLES) -> list[Path]:
    """A CA (reused if present) and a certificate per role and level; returns the files written."""
    ca = make_ca(out)
    written = []
    for lv in levels:
        for role in roles:
            written.extend(issue(out, role, lv, hosts, ca=ca))
    return written


# ---- reading ------------------------------------------------------------------------------
def read_identity(pem: bytes) -> Identity | None:
    """The (role, level) a certificate names, or None if it is not a Strata component certificate."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(ou) != 1 or len(cn) != 1:
        return None
    role = str(cn[0].value).split(".", 1)[0]
    level = str(ou[0].value)
    if role not in ROLES or str(cn[0].value) != dns_name(role, level):
        return None
    return Identity(role, level)


def peer_identity(context) -> Identity | None:
    """The verified client certificate's identity of a server-side call (None without TLS)."""
    ctx = context.auth_context() or {}
    pems = ctx.get("x509_pem_cert") or []
    return read_identity(pems[0]) if pems else None


def find_client_level(tls_dir: Path | str, lattice=None) -> str | None:
    """The level of the only client certificate in a directory (None if zero or several)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    found = sorted(Path(tls_dir).glob("client-*.pem"))
    if len(found) != 1:
        return None
    cert = x509.load_pem_x509_certificate(found[0].read_bytes())
    return str(cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value)


# ---- gRPC ---------------------------------------------------------------------------------
def _material(tls_dir: Path | str, role: str, level: str) -> tuple[bytes, bytes, bytes]:
    cert, key = cert_paths(tls_dir, role, level)
    ca = Path(tls_dir) / "ca.pem"
    missing = [str(p) for p in (ca, cert, key) if not p.exists()]
    if missing:
        raise TlsError(f"TLS material missing: {', '.join(missing)} (create it with `strata certs`)")
    return ca.read_bytes(), cert.read_bytes(), key.read_bytes()


def server_credentials(tls_dir: Path | str, role: str, level: str, also: tuple[str, ...] = ()) -> grpc.ServerCredentials:
    """``also``: more levels whose ``<role>`` certificate the server holds (a trusted master or worker,
    docs/trusted.md): the handshake presents the one whose name the caller pins (SNI), so a caller of
    level S meets ``<role>.S.strata`` as with a server of level S alone."""
    ca, cert, key = _material(tls_dir, role, level)
    pairs = [(key, cert)]
    for other in dict.fromkeys(lv for lv in also if lv != level):
        _, c, k = _material(tls_dir, role, other)
        pairs.append((k, c))
    return grpc.ssl_server_credentials(pairs, root_certificates=ca, require_client_auth=True)


def secure_channel(address: str, tls_dir: Path | str, role: str, level: str, peer_role: str,
                   options: list | None = None) -> grpc.Channel:
    """A channel that presents ``<role>-<level>`` and accepts only a ``<peer_role>`` of the same level."""
    ca, cert, key = _material(tls_dir, role, level)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    opts = list(options or []) + [("grpc.ssl_target_name_override", dns_name(peer_role, level))]
    return grpc.secure_channel(address, creds, opts)


class PeerCheck(grpc.ServerInterceptor):
    """Refuses every call whose client certificate is not one of ``roles`` at ``level``.

    Counts refusals in ``refused`` (reason → n) so they show in status.
    """

    def __init__(self, level: str, roles: tuple[str, ...], refused=None, levels: tuple[str, ...] = ()):
        """``levels``: the levels a trusted server serves (docs/trusted.md); default ``level`` alone."""
        self.level = level
        self.roles = roles
        self.refused = refused if refused is not None else {}
        self.levels = tuple(levels) or (level,)

    def refusal(self, context) -> tuple[grpc.StatusCode, str] | None:
        """(PERMISSION_DENIED, one line) if the caller's certificate is refused (counted), else None.
        ``context``: a server-side call's context, sync or ``grpc.aio`` (its ``auth_context()``)."""
        who = peer_identity(context)
        if who is None:
            reason, msg = "tls_no_identity", "a Strata component certificate is required"
        elif who.role not in self.roles:
            reason, msg = "tls_wrong_role", f"certificate of a {who.role}; this server serves {'/'.join(self.roles)}"
        elif who.level not in self.levels:
            serves = f"level {self.level}" if len(self.levels) == 1 else f"levels {', '.join(self.levels)}"
            reason, msg = "tls_wrong_level", f"certificate of level {who.level}; this server is of {serves}"
        else:
            return None
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return grpc.StatusCode.PERMISSION_DENIED, msg

    def _check(self, context) -> None:
        refusal = self.refusal(context)
        if refusal is not None:
            context.abort(*refusal)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        check = self._check

        def wrap(fn):
            def inner(request, context):
                check(context)
                return fn(request, context)
            return inner

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), handler.request_deserializer,
                                                     handler.response_serializer)
