"""Is a TCP port free to listen on, and if not, which process holds it (Linux /proc; elsewhere the
holder is just not named). `serve` asks before uvicorn starts: uvicorn would print "Application startup
complete" and only then exit with "address already in use"."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from app.errors import BadInput


def port_holder(port: int) -> str | None:
    """"pid N (command line)" of a process listening on `port`, when /proc says (None otherwise)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])  # 0A: LISTEN
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").glob("[0-9]*") if wanted else ():
        if wanted & _links(proc / "fd"):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            return f"pid {proc.name} ({cmdline[:120]})"
    return None


def _links(fds: Path) -> set[str]:
    found = set()
    try:
        for fd in fds.iterdir():
            try:
                found.add(os.readlink(fd))
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                continue
    except OSError:  # the process is gone, or not ours to look at
        pass
    return found


def check_port_free(host: str, port: int, *, option: str = "--port") -> None:
    """BadInput naming the holder and how to choose another port, when `host:port` is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    holder = port_holder(port)
    raise BadInput(f"port {port} on {host} is already in use" + (f" by {holder}" if holder else "") +
                   f"; stop that process or pick another port ({option} {port + 1}; the client commands "
                   "then need WAVEFARM_API_URL or --api with it)")
