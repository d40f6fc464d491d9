"""Is the rendezvous port free where this launcher will open it? Checked before any process starts."""

from __future__ import annotations

import errno
import ipaddress
import socket

from trainer_ext.cli.launch.settings import Settings


def port_problem(host: str, port: int) -> str | None:
    """'port in use' when ``port`` cannot be bound here; None when free or when ``host`` is another machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))  # is the address one of this machine's?
        except OSError:
            return None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "", port))  # torch's store listens on all interfaces
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on this machine; pick another --main_process_port"
            return f"port {port} cannot be opened: {error.strerror}"
    return None


def port_problems(s: Settings) -> list[str]:
    """The rendezvous port must be free where this launcher will open it.

    That is the only machine, machine 0 of a static rendezvous, and under c10d the machine whose address is
    main_process_ip (torch hosts the store there; on a busy port it would join whatever listens instead).
    """
    port, host, backend = s["main_process_port"], s["main_process_ip"], s["rdzv_backend"]
    if not port or host is None or backend not in ("static", "c10d"):
        return []  # a free port chosen at start, no rendezvous, or an external etcd server
    several = s["num_machines"] > 1
    if several and backend == "static" and s["machine_rank"] != 0:
        return []  # connects to machine 0
    problem = port_problem(host, port)
    if problem is None:
        return []
    if several and backend == "c10d":
        if _is_loopback(host):  # every machine of the job is on this host: the store may be another one's
            s.notes.append(
                f"port {port} on {host} is already in use: fine if another machine of this job (started on this "
                "same host) hosts the rendezvous there; otherwise pick another --main_process_port"
            )
            return []
        problem += (
            f" (the c10d rendezvous store is hosted here, at main_process_ip {host}; several launchers of one job "
            "on this same host meet on main_process_ip 127.0.0.1)"
        )
    return [problem]


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name
        return False
