"""Connections that cannot hang: a rig that stops answering fails within a bounded time.

pyinfra's SSH connector (paramiko) waits for a silent rig as long as TCP does: for ever while
it only reads a command's output (nothing is sent, so nothing goes unacknowledged), and about
15 minutes of retransmissions (Linux's tcp_retries2) once it sends. A link that went away hung
a whole fleet run without a word: every other rig waits at the same operation.

So every rig's connection gets, as soon as a deploy starts and again at every reconnect (a
reboot): an SSH keepalive every `link_keepalive` seconds of sending nothing (paramiko's
`Transport.set_keepalive`), which gives TCP something to wait an answer for, and
`TCP_USER_TIMEOUT` of `link_lost_after` seconds, after which Linux drops a connection whose
sent data stays unacknowledged. The rig's transport then ends, its command fails, rigbook says
"lost the connection to RIG" (`lost_text`) and pyinfra goes on with the other rigs.

The bound: link_keepalive + link_lost_after seconds after the rig stopped answering (60 s by
default). A busy rig is not a silent one: its kernel acknowledges while apt or a build holds
its CPUs. Connecting is bounded by pyinfra and paramiko themselves: the TCP connect and the
SSH handshake by pyinfra's CONNECT_TIMEOUT (10 s, one for the run), the authentication by
paramiko's 30 s; a rig's own bound is pyinfra's ssh_paramiko_connect_kwargs host-data key
({"timeout": N}). docs/faults-fleet.md has the operator's side.
"""

from __future__ import annotations

import socket

from pyinfra.api import Host, State
from pyinfra.api.state import BaseStateCallback

from rigbook.core.spec import Rig

#: Host name -> (link_keepalive, link_lost_after) of the rigs this process bounded.
_BOUNDS: dict[str, tuple[int, int]] = {}


def _transport(host: Host):
    """The paramiko transport of a host's SSH connection; None for another connector."""
    client = getattr(host.connector, "client", None)
    return client.get_transport() if client is not None else None


def _apply(host: Host) -> None:
    transport = _transport(host)
    if transport is None or host.name not in _BOUNDS:
        return
    keepalive, lost_after = _BOUNDS[host.name]
    transport.set_keepalive(keepalive)
    sock = transport.sock
    if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):  # not a jump host's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, lost_after * 1000)


class Reconnects(BaseStateCallback):
    """Bound the new connection of a rig that reconnects (after a reboot)."""

    @staticmethod
    def host_connect(state: State, host: Host):
        _apply(host)


def bound(state: State, host: Host, rig: Rig) -> None:
    """Bound this rig's connection now, and its later ones (the first call per run adds the
    callback that does)."""
    _BOUNDS[host.name] = (rig.link_keepalive, rig.link_lost_after)
    if not any(isinstance(handler, Reconnects) for handler in state.callback_handlers):
        state.add_callback_handler(Reconnects())
    _apply(host)


def lost(host: Host) -> bool:
    """True when the host's SSH connection was made and has ended (not while it is up, and
    never for a connector without one, like @local)."""
    client = getattr(host.connector, "client", None)
    if client is None:
        return False
    transport = client.get_transport()
    return transport is None or not transport.is_active()


def lost_text(host: Host) -> str:
    """What a rig whose connection was lost says, with the bound it was lost within."""
    keepalive, lost_after = _BOUNDS.get(host.name, (None, None))
    if keepalive is None:
        return f"lost the connection to {host.name}"
    return (f"lost the connection to {host.name}: no answer within {keepalive + lost_after} s "
            f"(link_keepalive {keepalive} s + link_lost_after {lost_after} s), or the rig "
            "closed it")
