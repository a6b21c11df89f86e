"""Certificates: what `strata certs` writes, what the subject says, and that servers refuse to run without it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from cryptography import x509
from cryptography.x509.oid import NameOID

from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML
from strata.tls import Identity, create_deployment, find_client_level, read_identity


def test_certs_name_component_and_level(tmp_path):
    files = create_deployment(tmp_path, ["S", "[1,B]"])
    assert len(files) == 12  # 3 roles x 2 levels x (pem, key)
    for role in ("master", "worker", "client"):
        for level, slug in (("S", "S"), ("[1,B]", "1_B")):
            pem = (tmp_path / f"{role}-{slug}.pem").read_bytes()
            assert read_identity(pem) == Identity(role, level)
            cert = x509.load_pem_x509_certificate(pem)
            assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == level
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert f"{role}.{slug.lower()}.strata" in san.get_values_for_type(x509.DNSName)
            mode = stat.S_IMODE(os.stat(tmp_path / f"{role}-{slug}.key").st_mode)
            assert mode == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600


def test_ca_is_reused_and_client_level_found(tmp_path):
    create_deployment(tmp_path, ["S"], roles=("client",))
    ca = (tmp_path / "ca.pem").read_bytes()
    create_deployment(tmp_path, ["TS"], roles=("master",))
    assert (tmp_path / "ca.pem").read_bytes() == ca  # one CA per deployment
    assert find_client_level(tmp_path) == "S"
    create_deployment(tmp_path, ["TS"], roles=("client",))
    assert find_client_level(tmp_path) is None  # two client certificates: the caller must choose


def test_read_identity_rejects_foreign_certificates(tmp_path):
    create_deployment(tmp_path, ["S"], roles=("client",))
    assert read_identity((tmp_path / "ca.pem").read_bytes()) is None  # no OU / not a component
    assert read_identity(b"garbage") is None


def _strata(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True, timeout=120,
                           cwd=cwd)


def test_cli_certs_and_servers_refuse_to_start_without_certificates(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(AUDIT_TOML)
    r = _strata("certs", "--config", str(cfg), "--levels", "[1,B],[⊥,T]", "--out", str(tmp_path / "tls"),
                "--hosts", "10.0.0.5,node1.example")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tls" / "worker-bot_T.pem").exists()
    san = x509.load_pem_x509_certificate((tmp_path / "tls" / "master-1_B.pem").read_bytes()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node1.example" in san.get_values_for_type(x509.DNSName)
    cfg2 = tmp_path / "b.toml"
    cfg2.write_text(BATTLEFIELD_TOML)
    for role in ("master", "worker"):
        r = _strata(role, "--config", str(cfg2), "--level", "S", "--state-dir", str(tmp_path / "st"))
        assert r.returncode == 1
        assert "no TLS certificate" in r.stderr and "strata certs" in r.stderr
    r = _strata("certs", "--config", str(cfg2), "--levels", "Q", "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_cli_certs_roles_scraper_and_a_bad_role(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    r = _strata("certs", "--config", str(cfg), "--levels", "S", "--out", str(tmp_path / "bad"), "--roles", "client,bogus")
    assert r.returncode == 2 and "unknown role bogus" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()  # nothing written, not even a CA
    r = _strata("certs", "--config", str(cfg), "--levels", "S", "--out", str(tmp_path / "pki"), "--roles", "scraper",
                "--hosts", "node1.example")
    assert r.returncode == 0, r.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "pki" / "scraper-S.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "scraper.s.strata"
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert [u._name for u in eku] == ["clientAuth"]  # a scraper is only ever a client: no server use, no hosts
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["scraper.s.strata"]
