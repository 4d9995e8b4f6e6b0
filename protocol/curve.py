"""CURVE keys for `tcp://` endpoints: the server's keypair plus an allow-list of client
public keys, enforced by a ZAP handler thread (pyzmq's ThreadAuthenticator)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "tandem"


def new_keypair() -> tuple[bytes, bytes]:
    """A fresh (public, secret) pair of Z85 keys (40 bytes each)."""
    return zmq.curve_keypair()


def _check_key(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != 40:
        raise ValueError(f"{what} must be a 40-byte Z85 CURVE key (see protocol.curve.new_keypair)")


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """Keys of a binding (server) socket; only clients whose public key is listed get in."""

    public_key: bytes
    secret_key: bytes
    client_public_keys: frozenset[bytes]

    def __post_init__(self) -> None:
        _check_key(self.public_key, "public_key")
        _check_key(self.secret_key, "secret_key")
        if not self.client_public_keys:
            raise ValueError("client_public_keys is empty: no client could connect")
        for key in self.client_public_keys:
            _check_key(key, "client public key")


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """Keys of a connecting (client) socket: its own pair and the server's public key."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes

    def __post_init__(self) -> None:
        _check_key(self.public_key, "public_key")
        _check_key(self.secret_key, "secret_key")
        _check_key(self.server_public_key, "server_public_key")


class _AllowList:
    def __init__(self, keys: frozenset[bytes]):
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def make_server(sock: zmq.Socket, keys: CurveServerKeys) -> ThreadAuthenticator:
    """Make `sock` a CURVE server (call before bind). The returned authenticator answers
    ZAP requests for the socket's context; stop() it after closing the socket."""
    auth = ThreadAuthenticator(zmq.Context.shadow(sock.context.underlying))
    auth.start()
    allow = _AllowList(keys.client_public_keys)
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=allow)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True
    return auth


def make_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make `sock` a CURVE client of the server with `keys.server_public_key` (before connect)."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.server_public_key
