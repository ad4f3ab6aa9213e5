"""The fault server itself, checked with the standard library's HTTP client (not infra.fetch)."""

from __future__ import annotations

import hashlib
import http.client

import pytest

from tests.support.fault_server import Fault, FaultServer

from .conftest import SHARD


def get(server: FaultServer, path: str, method: str = "GET", **headers) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        try:
            body = resp.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return resp.status, dict(resp.getheaders()), body
    finally:
        conn.close()


def test_serves_files_with_validators_and_ranges(server, corpus):
    data = (corpus / SHARD.lstrip("/")).read_bytes()
    status, headers, body = get(server, SHARD)
    assert (status, body) == (200, data)
    assert headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"' and headers["Content-Length"] == str(len(data))
    status, headers, body = get(server, SHARD, Range="bytes=100-")
    assert (status, body, headers["Content-Range"]) == (206, data[100:], f"bytes 100-{len(data) - 1}/{len(data)}")
    status, _, body = get(server, SHARD, Range="bytes=10-19", **{"If-Range": headers["ETag"]})
    assert (status, body) == (206, data[10:20])
    status, _, body = get(server, SHARD, Range="bytes=10-", **{"If-Range": '"stale"'})
    assert (status, body) == (200, data)  # a stale validator gets the whole file
    assert get(server, SHARD, Range=f"bytes={len(data)}-")[0] == 416
    status, headers, body = get(server, SHARD, method="HEAD")
    assert (status, body, headers["Content-Length"]) == (200, b"", str(len(data)))
    assert get(server, "/train/../../etc/passwd")[0] == 404
    assert get(server, "/nope")[0] == 404


def test_faults_are_consumed_in_order_per_path(server, corpus):
    data = (corpus / SHARD.lstrip("/")).read_bytes()
    other = "/train/chunk2/example_train_1.jsonl.zst"
    server.add_faults(SHARD, Fault(status=429, retry_after="7"), Fault(truncate_at=1000), Fault(etag="v2"))
    status, headers, _ = get(server, SHARD)
    assert (status, headers["Retry-After"]) == (429, "7")
    assert get(server, other)[0] == 200  # another path does not consume SHARD's faults
    status, _, body = get(server, SHARD)
    assert status == 200 and body == data[:1000]
    assert get(server, SHARD)[1]["ETag"] == '"v2"'
    assert get(server, SHARD)[2] == data
    assert [(r.path, r.attempt, r.status) for r in server.requests] == [
        (SHARD, 1, 429),
        (other, 1, 200),
        (SHARD, 2, 200),
        (SHARD, 3, 200),
        (SHARD, 4, 200),
    ]
    assert server.count(SHARD) == 4 and server.count() == 5


def test_reset_redirect_always_and_checksums(corpus):
    data = (corpus / SHARD.lstrip("/")).read_bytes()
    with FaultServer(
        corpus, ranges=False, checksums=("x-linked-etag", "content-md5"), always={"/gone": Fault(status=410)}
    ) as srv:
        srv.add_faults(
            SHARD, Fault(reset_at=5000), Fault(redirect="http://elsewhere.example/x"), Fault(bad_checksum=True)
        )
        with pytest.raises((ConnectionResetError, http.client.HTTPException)):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            conn.request("GET", SHARD)
            conn.getresponse().read()
        status, headers, _ = get(srv, SHARD)
        assert (status, headers["Location"]) == (302, "http://elsewhere.example/x")
        _, bad, _ = get(srv, SHARD)
        _, good, body = get(srv, SHARD, Range="bytes=5-")  # ranges=False: whole file
        assert body == data and "Accept-Ranges" not in good
        assert good["X-Linked-Etag"] == f'"{hashlib.sha256(data).hexdigest()}"' != bad["X-Linked-Etag"]
        assert get(srv, "/gone")[0] == get(srv, "/gone")[0] == 410
        assert srv.requests_for(SHARD)[0].headers["Host"].startswith("127.0.0.1")
