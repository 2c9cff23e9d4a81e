"""vLLM's `vllm.utils.network_utils`: ports."""

import socket


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it
    before the caller binds it, as with vLLM's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
