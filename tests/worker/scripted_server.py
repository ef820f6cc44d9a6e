"""A real local HTTP server whose answers a test decides, request by request."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = tuple[int, str, bytes]  # status, content type, body
HeadedAnswer = tuple[int, str, bytes, dict[str, str]]  # and further headers


@contextlib.contextmanager
def serving(answer: Callable[[str, str], Answer | HeadedAnswer]) -> Iterator[str]:
    """Serve on a free local port, answering each request with ``answer(method, path)``; yields the
    base URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status, content_type, body, *more = answer(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in (more[0] if more else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
