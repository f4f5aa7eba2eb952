"""The buffer over a unix socket: what a host without inet sockets runs (a TPU VM), end to end."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.endpoints import Address, parse
from stoker.trajectory import Episode

Groups = Callable[..., list[Episode]]
ServerFactory = Callable[..., BufferServer]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost")
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def test_put_sample_commit_health_and_metrics_over_unix_sockets(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups, tmp_path: Path
) -> None:
    address = parse(f"unix://{tmp_path}/buffer.sock", where="test")
    metrics = parse(f"unix://{tmp_path}/metrics.sock", where="test")
    server = server_factory(settings, address=address, metrics_address=metrics)
    assert server.address == address and server.port == 0
    with grpc.insecure_channel(address.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="stoker.v1.Buffer"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with BufferClient(address.target, client_id="test") as client:
        client.put(make_group(2, actor_id="actor-u"))
        batch = client.sample(1, min_groups=1, timeout=5)
        assert batch is not None and len(batch.groups[0].episodes) == 2
        assert client.commit(batch.batch_id) == 2
    connection = UnixHTTPConnection(str(metrics.path))
    connection.request("GET", "/metrics")
    body = connection.getresponse().read().decode()
    assert 'stoker_buffer_actor_accepted_trajectories_total{actor="actor-u"} 2.0' in body


def test_a_metrics_endpoint_that_cannot_listen_is_off_and_the_buffer_serves(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = server_factory(settings, metrics_address=Address(host="127.0.0.1", port=port))
        assert server.metrics_port is None
        with BufferClient(f"127.0.0.1:{server.port}") as client:
            client.put(make_group(2))
            assert client.stats().stored_trajectories == 2
