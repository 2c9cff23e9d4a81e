"""What every way of starting data-parallel engine cores shares: the local cores of
`dp_client`, a headless host's (`dp_headless`) and Ray's actors (`dp_ray`) each take their
threads, ports and readiness from here. Below those three, so that none imports another's
helpers (they imported each other in a circle)."""

import os
import socket
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: this module stays light (no torch) for dp_headless
    from v1.engine.launch import EngineLaunch


def cores_for(num_engines: int) -> int:
    """Each core's torch threads: its share of the CPU cores this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // num_engines)


def wait_all(launches: "list[EngineLaunch]") -> list[Any]:
    """Each launch's process once all are ready; the first failure is raised at once (the
    caller stops the others rather than wait for their models to load)."""
    procs: dict[int, Any] = {}
    while len(procs) < len(launches):
        pending = {i: launch for i, launch in enumerate(launches) if i not in procs}
        handles = {}
        for i, launch in pending.items():
            handles[launch.reader] = i
            handles[launch.proc.sentinel] = i
        for handle in wait(list(handles)):
            i = handles[handle]
            if i not in procs:
                procs[i] = launches[i].wait()  # ready (or raises) without waiting
    return [procs[i] for i in range(len(launches))]


def local_ip_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port_pair(ip: str) -> int:
    """A port P such that P and P + 1 (an engine core's input and output sockets) are free."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind((ip, 0))
            port = a.getsockname()[1]
            try:
                b.bind((ip, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no two consecutive free ports on {ip}")
