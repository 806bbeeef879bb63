"""A moto S3 server on 127.0.0.1 for the tests that read corpora from, or write checkpoints to, ``s3://``."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from types import SimpleNamespace

import pytest

__all__ = ["free_port", "s3_server"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _recording(app, requests: list):
    """The WSGI application ``app`` that first appends each request to ``requests``."""

    def recorded(environ, start_response):
        requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE")))
        return app(environ, start_response)

    return recorded


@contextlib.contextmanager
def s3_server(bucket: str = "flexorch-test", host: str = "127.0.0.1"):
    """A moto S3 server on ``host`` (loopback, or the bridge of emulated hosts) with ``bucket``; inside the block the
    process's AWS settings point at it (and only there). Yields ``endpoint``, ``root`` (``s3://bucket``), ``env``:
    the variables a Ray job's ``runtime_env`` passes on so its workers reach the server too, and ``requests``: every
    request the server answered, as (method, path, ``Range`` header or None), for tests that count them."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address=host, port=free_port(host), verbose=False)
    server.start()
    requests: list[tuple[str, str, str | None]] = []
    server._server.app = _recording(server._server.app, requests)  # moto's werkzeug server (private): read per request
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": endpoint,
    }
    try:
        with pytest.MonkeyPatch.context() as mp:
            for var in list(os.environ):
                if var.startswith("AWS_") or var.startswith("FLEXORCH_S3"):
                    mp.delenv(var)
            for var, value in env.items():
                mp.setenv(var, value)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            yield SimpleNamespace(endpoint=endpoint, root=f"s3://{bucket}", env=env, boto3=boto3, requests=requests)
    finally:
        server.stop()
