"""TLS of the servers sharegpu runs (the extender, the webhook): the certificate files checked up front, so that a
junk, swapped or mismatched file is reported by name and cause instead of OpenSSL's bare ``[SSL] PEM lib``.

With a client CA the server asks every client for a certificate and refuses a connection without one that CA
signed (mutual TLS): that is how only the kube-scheduler may call the extender.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

CERT_BLOCK = b"-----BEGIN CERTIFICATE-----"
KEY_MARK = b"PRIVATE KEY-----"


class TlsError(Exception):
    """A certificate, key or CA file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    cert: Path  # PEM certificate (chain) the server presents
    key: Path  # PEM private key of ``cert``
    client_ca: Path | None = None  # PEM CA(s) whose certificates clients must present; None: no client certificates

    def context(self) -> ssl.SSLContext:
        """The server's SSL context, built from the files; raises :class:`TlsError`."""
        cert_pem = _read(self.cert, "--tls-cert")
        key_pem = _read(self.key, "--tls-key")
        if CERT_BLOCK not in cert_pem:
            if KEY_MARK in cert_pem:
                raise TlsError(
                    f"--tls-cert {self.cert} holds a private key, not a certificate: are --tls-cert and "
                    "--tls-key swapped?"
                )
            raise TlsError(f"--tls-cert {self.cert} is not a PEM certificate (no '{CERT_BLOCK.decode()}' block)")
        if KEY_MARK not in key_pem:
            if CERT_BLOCK in key_pem:
                raise TlsError(
                    f"--tls-key {self.key} holds a certificate, not a private key: are --tls-cert and "
                    "--tls-key swapped?"
                )
            raise TlsError(
                f"--tls-key {self.key} is not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' block)"
            )
        if b"ENCRYPTED" in key_pem:
            raise TlsError(f"--tls-key {self.key} is encrypted with a passphrase; give the unencrypted key")
        _check_certs(self.cert, cert_pem, "--tls-cert")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except ssl.SSLError as e:
            if "KEY_VALUES_MISMATCH" in str(e) or e.reason == "KEY_VALUES_MISMATCH":
                raise TlsError(
                    f"--tls-key {self.key} is not the key of the certificate in --tls-cert {self.cert}"
                ) from None
            # OpenSSL says only "PEM lib" for a key block that does not decode.
            detail = "" if e.reason is None and "PEM lib" in str(e) else f" ({_ssl_reason(e)})"
            raise TlsError(
                f"--tls-key {self.key} cannot be used with --tls-cert {self.cert}: its private key block does not "
                f"parse{detail}"
            ) from None
        if self.client_ca is not None:
            ca_pem = _read(self.client_ca, "--client-ca")
            if CERT_BLOCK not in ca_pem:
                hint = " (it holds a private key)" if KEY_MARK in ca_pem else ""
                raise TlsError(f"--client-ca {self.client_ca} is not a PEM CA certificate{hint}")
            _check_certs(self.client_ca, ca_pem, "--client-ca")
            ctx.load_verify_locations(str(self.client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def describe(self) -> str:
        if self.client_ca is None:
            return f"HTTPS with certificate {self.cert}"
        return f"HTTPS with certificate {self.cert}; only clients with a certificate from {self.client_ca} are served"


def _read(path: Path, flag: str) -> bytes:
    if path.is_dir():
        raise TlsError(f"{flag} {path} is a directory, not a PEM file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{flag} {path} does not exist") from None
    except OSError as e:
        raise TlsError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def _check_certs(path: Path, pem: bytes, flag: str) -> None:
    """Check that every certificate block of ``pem`` parses (in a throwaway context: the server's own certificate
    must never become a trust anchor for clients)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError) as e:
        raise TlsError(f"{flag} {path} holds a certificate block that does not parse: {_ssl_reason(e)}") from None


def _ssl_reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError) and e.reason:
        return str(e.reason)
    return str(e) or type(e).__name__
