"""Tandem's wires: typed messages (`messages`), the msgpack + ndarray-frame codec (`codec`),
one wrapper per socket role (`sockets`) and the ZeroMQ client library (`client`)."""

from protocol.client import AsyncTandemClient, Completion, TandemClient
from protocol.errors import ProtocolError, TandemError
from protocol.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "AsyncTandemClient", "Completion", "ProtocolError",
           "TandemClient", "TandemError"]
