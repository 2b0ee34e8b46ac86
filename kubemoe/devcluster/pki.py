"""Certificates and keys for a throw-away control plane, made with the openssl CLI.

EC P-256 keys: generated in milliseconds, and accepted by the API server for TLS, client certificates
and service-account token signing (ES256).
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

ADMIN_USER = "kubemoe-admin"


@dataclasses.dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _issue(pki: Pki, name: str, subject: str, extensions: list[str]) -> None:
    """Key + certificate signed by the CA (OpenSSL >= 3.0 signs in one `req -x509 -CA` call)."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(pki.key(name)), "-out", str(pki.cert(name)), "-days", "30", "-subj", subject,
             "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
             *(arg for ext in extensions for arg in ("-addext", ext)))


def create_pki(directory: Path) -> Pki:
    """CA, API server serving cert, admin client cert (group system:masters) and the
    service-account signing key pair (sa.key, sa.pub)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(pki.ca_key), "-out", str(pki.ca_cert), "-days", "30",
             "-subj", "/CN=kubemoe-devcluster-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    # 10.0.0.1 is the `kubernetes` Service IP in the 10.0.0.0/24 service range the API server uses.
    _issue(pki, "apiserver", "/CN=kube-apiserver", [
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        "extendedKeyUsage=serverAuth", "basicConstraints=critical,CA:FALSE"])
    _issue(pki, "admin", f"/O=system:masters/CN={ADMIN_USER}", [
        "extendedKeyUsage=clientAuth", "basicConstraints=critical,CA:FALSE"])
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", str(pki.key("sa")))
    _openssl("pkey", "-in", str(pki.key("sa")), "-pubout", "-out", str(directory / "sa.pub"))
    return pki
