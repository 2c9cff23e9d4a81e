"""vLLM's `vllm.utils.network_utils`: ports."""

import argparse
import socket


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it
    before the caller binds it, as with vLLM's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tcp_port(text: str) -> int:
    """A command-line TCP port (`--port`): argparse reports anything but 1..65535 as a
    usage error naming the value."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text!r}")
    return port
