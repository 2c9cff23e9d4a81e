"""One client's connection to an engine core process over ZMQ (`v1.engine.protocol`).

`EngineConnection` owns a PUSH to the core's input and a DEALER on its output (monitored for
disconnection): `hello()` handshakes, `send()` sends, and `receive()`, the receiver thread's
body, hands messages to callbacks and raises `EngineDeadError` when the engine is gone. Each
socket is used by one thread.
"""

import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from v1.engine.exceptions import EngineDeadError
from v1.engine.launch import exit_status
from v1.engine.protocol import (
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityResult,
    client_routing_id,
    output_address,
)
from v1.outputs import EngineCoreOutputs

# How long a client waits for READY from an engine it did not start (it may not be there).
CONNECT_TIMEOUT_S = 30.0
POLL_MS = 100  # how soon the receiver sees a stop, a disconnection or an exit


class EngineConnection:
    """Client `client_index`'s sockets to the engine core at `address`, in `ctx`; `proc`:
    the engine process when this client owns it (its exit is watched), else None."""

    def __init__(
        self, ctx: zmq.Context, address: str, client_index: int, proc: BaseProcess | None
    ) -> None:
        self.address = address
        self.client_index = client_index
        self.proc = proc
        self._input = ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # sends never block
        self._output = ctx.socket(zmq.DEALER)
        self._output.setsockopt(zmq.ROUTING_ID, client_routing_id(client_index))
        self._output.setsockopt(zmq.RCVHWM, 0)
        # Before connecting, so that no disconnection goes unseen.
        self._monitor = self._output.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._output.connect(output_address(address))
        self._input.connect(address)

    def send(self, kind: EngineCoreRequestType, data: bytes) -> None:
        """Send one encoded message (the caller serialises sends)."""
        # Copied, as the engine's sends (see `EngineCoreProc._send`): zero-copy would wake
        # pyzmq's garbage-collector thread for each frame over 64 KB.
        self._input.send_multipart((kind.value, data))

    def hello(self) -> EngineCoreReady:
        """HELLO, then wait for READY: EngineDeadError if the engine process dies first,
        TimeoutError if an engine this client did not start does not answer."""
        self.send(EngineCoreRequestType.HELLO, msgspec.msgpack.encode(self.client_index))
        waited_ms, proc = 0, self.proc
        while not self._output.poll(POLL_MS):
            waited_ms += POLL_MS
            if proc is not None and not proc.is_alive():
                raise EngineDeadError(f"the engine core process died ({exit_status(proc)})")
            if proc is None and waited_ms >= CONNECT_TIMEOUT_S * 1000:
                raise TimeoutError(
                    f"no engine core answered at {self.address} within "
                    f"{CONNECT_TIMEOUT_S:.0f} s (is one running there? is client_index "
                    f"{self.client_index} taken?)"
                )
        kind, payload = self._output.recv_multipart()
        if kind != EngineCoreOutputType.READY.value:
            raise RuntimeError(
                f"the engine core at {self.address} did not answer HELLO with READY"
            )
        return msgspec.msgpack.decode(payload, type=EngineCoreReady)

    def receive(
        self,
        stop: threading.Event,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_result: Callable[[UtilityResult], None],
    ) -> None:
        """Hand every message to its callback until `stop` is set; raise EngineDeadError
        when the engine is gone (its death notice's reason when it sent one)."""
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        proc = self.proc
        if proc is not None:
            poller.register(proc.sentinel, zmq.POLLIN)
        outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        result_decoder = msgspec.msgpack.Decoder(UtilityResult)
        while not stop.is_set():
            events = dict(poller.poll(POLL_MS))
            # Read what the engine sent before judging a disconnection or an exit: the
            # death notice, when there is one, says why.
            while self._output.poll(0):
                kind, payload = self._output.recv_multipart(copy=False)
                if kind.bytes == EngineCoreOutputType.OUTPUTS.value:
                    outputs = outputs_decoder.decode(payload.buffer)
                    if outputs.engine_error is not None:
                        raise EngineDeadError(outputs.engine_error)
                    on_outputs(outputs)
                elif kind.bytes == EngineCoreOutputType.UTILITY_RESULT.value:
                    on_result(result_decoder.decode(payload.buffer))
            if self._monitor in events or (proc is not None and proc.sentinel in events):
                if proc is None:
                    raise EngineDeadError(f"the engine core at {self.address} disconnected")
                raise EngineDeadError(f"the engine core process died ({exit_status(proc)})")
