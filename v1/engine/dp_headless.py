"""Data-parallel engine cores on another host, without Ray: vLLM's `--headless`.

The frontend runs its local ranks and waits at `tcp://data_parallel_address:
data_parallel_rpc_port`; each other host (`serve --headless --data-parallel-start-rank R`)
starts its cores on `tcp://ITS_IP:PORT` and sends REGISTER [(rank, address), ...]. The
registration connection stays open: when the frontend goes away, or on SIGTERM/SIGINT, the
headless process stops its cores and exits. Details: docs/data-parallel.md.
"""

import logging
import signal
import threading
from collections.abc import Iterable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from v1.config import EngineArgs
from v1.engine.dp_launch import cores_for, free_port_pair, local_ip_towards, wait_all

logger = logging.getLogger("v1")

REGISTER = b"REGISTER"
# How long a frontend waits for the remote cores to register (they load their models first).
REGISTRATION_TIMEOUT_S = 600.0


class RegistrationServer:
    """The frontend's side: where headless cores say where they are."""

    def __init__(self, host: str, port: int) -> None:
        self.address = f"tcp://{host}:{port}"
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(
                f"cannot listen for data-parallel engine cores at {self.address}: {e}"
            ) from None

    def wait_for(self, ranks: Iterable[int], timeout_s: float = REGISTRATION_TIMEOUT_S
                 ) -> dict[int, str]:
        """Each of `ranks`' engine address, as their headless processes register them."""
        wanted, found = set(ranks), {}
        logger.info(
            "waiting for data-parallel engine cores %s to register at %s (python -m v1 serve "
            "--headless on their hosts)", sorted(wanted), self.address,
        )
        decoder = msgspec.msgpack.Decoder(list[tuple[int, str]])
        waited_ms = 0
        while wanted - found.keys():
            if not self._socket.poll(100):
                waited_ms += 100
                if waited_ms >= timeout_s * 1000:
                    raise TimeoutError(
                        f"engine cores {sorted(wanted - found.keys())} did not register at "
                        f"{self.address} within {timeout_s:.0f} s"
                    )
                continue
            frames = self._socket.recv_multipart()
            try:
                _, kind, payload = frames
                assert kind == REGISTER
                cores = decoder.decode(payload)
            except (ValueError, AssertionError, msgspec.DecodeError):
                logger.warning("dropped a malformed registration at %s", self.address)
                continue
            for rank, address in cores:
                if rank not in wanted or rank in found:
                    logger.warning("ignored a registration of engine core %d (%s)", rank, address)
                else:
                    found[rank] = address
                    logger.info("engine core %d registered at %s", rank, address)
        return found

    def close(self) -> None:
        """Headless processes see the connection drop, and exit."""
        self._ctx.destroy(linger=0)


def run_headless(args: EngineArgs) -> None:
    """`python -m v1 serve --headless`: start this host's cores, register them with the
    frontend, serve until the frontend goes away or a signal comes."""
    from v1.engine.launch import EngineLaunch, stop_process

    local = args.data_parallel_size_local
    if local is None or local < 1:
        raise ValueError("--headless needs --data-parallel-size-local >= 1 (its cores)")
    ranks = range(args.data_parallel_start_rank, args.data_parallel_start_rank + local)
    ip = local_ip_towards(args.data_parallel_address)
    threads = cores_for(local)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    launches = [
        EngineLaunch(args, f"tcp://{ip}:{free_port_pair(ip)}", threads, name=f"v1-engine-dp{r}")
        for r in ranks
    ]
    addresses = [launch.address for launch in launches]
    try:
        procs = wait_all(launches)
    except BaseException:
        for launch in launches:
            launch.cancel()
        raise
    ctx = zmq.Context()
    try:
        frontend = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
        sock = ctx.socket(zmq.DEALER)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(frontend)
        sock.send_multipart(
            (REGISTER, msgspec.msgpack.encode(list(zip(ranks, addresses))))
        )
        logger.info(
            "engine cores %s (%s) registering with the frontend at %s",
            list(ranks), ", ".join(addresses), frontend,
        )
        connected = False
        while not stop.is_set():
            if not any(p.is_alive() for p in procs):
                logger.error("every engine core of this host has exited")
                break
            if not monitor.poll(200):
                continue
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event == zmq.EVENT_DISCONNECTED and connected:
                logger.info("the frontend at %s went away: stopping", frontend)
                break
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            stop_process(proc)
        ctx.destroy(linger=0)
