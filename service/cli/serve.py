"""``multicomposite serve``: the HTTP API and the dashboard on uvicorn.

The port is bound here, before the app starts: a port in use (or an address this host does not have) is one line
and exit code 2, not a traceback after "Application startup complete"."""

from __future__ import annotations

import argparse
import socket

from service.cli import arguments
from service.cli_output import UsageError


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or UsageError saying why not and what to do."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise UsageError(f"cannot listen on --host {host!r}: {error.strerror}; use an address of this host, e.g. "
                         "127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if error.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise UsageError(f"port {port} on {host} is in use (another server?); stop it, or choose another port "
                             "with --port") from None
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror}; choose another --host or --port"
                         ) from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import importlib.util

    import uvicorn

    from registry.store.connection import StoreUnavailableError
    from service.main import create_app
    from service.settings import SettingsError, load_settings
    from service.state import StoreState

    try:
        settings = load_settings(host=args.host, port=args.port)
        probe = StoreState(settings.db, settings.evidence_poll_s, 1)
        probe.open()  # an unreachable store refuses the start here, in one line, not in a traceback
        probe.close()
    except (SettingsError, StoreUnavailableError) as error:
        raise UsageError(str(error)) from None
    sock = bind(settings.host, settings.port)
    # uvloop and httptools when installed (they are dependencies): the throughput the docs report is theirs.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "auto"
    http = "httptools" if importlib.util.find_spec("httptools") else "auto"
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                            access_log=False, loop=loop, http=http)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="the address to listen on (default: MULTICOMPOSITE_HOST or "
                        "127.0.0.1)")
    parser.add_argument("--port", type=arguments.port, default=None, help="the port to listen on, 1..65535 "
                        "(default: MULTICOMPOSITE_PORT or 8000)")
    parser.set_defaults(run=run)
