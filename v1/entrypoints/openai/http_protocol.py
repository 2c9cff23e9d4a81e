"""The HTTP/1.1 protocol the server runs: uvicorn's h11 one (why h11: `api_server.main`),
answering a request it cannot parse (a malformed request line, headers past their bound)
with OpenAI's JSON error body, as every other refusal, instead of uvicorn's plain text."""

import sys

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from v1.entrypoints.openai.protocol import ErrorResponse


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this from its handler of h11's RemoteProtocolError: that error says why.
        error = sys.exception()
        if getattr(error, "error_status_hint", None) == 431:  # h11's receive buffer is full
            limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            message = f"the request's headers are over {limit} bytes (the limit)"
        else:
            # h11 quotes the offending line, up to the 16 KiB bound: the start says enough.
            message = f"invalid HTTP request: {str(error or msg)[:200]}"
        body = ErrorResponse.make(400, message).model_dump_json().encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
