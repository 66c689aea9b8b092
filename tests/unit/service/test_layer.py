"""The service layer (models/service/) with a plain host: ops called through the client, the token, a failed op,
the binary body, the stop op, the idle and parent stops; every refusal of the layer (an unknown op, a config or
another argument the op does not take, a location outside the service's root, another config's digest, the
guard's 411/400/413) before the host runs anything; the address book by launch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from models.service import book
from models.service.client import ServiceClient, ServiceError, ServiceGone
from models.service.ops import Host, op
from models.service.server import Server, Settings, serve_ranks
from models.service.token import SECRET_ENV, service_token

TOKEN = "tok-en"


class Recorder(Host):
    label = "the actor trainer service"

    def __init__(self):
        self.seen = []

    @op
    def score(self, state: dict, batch: str):
        self.seen.append(("score", batch))
        return {"n": len(self.seen), "iteration": state["iteration"]}

    @op
    def boom(self):
        self.seen.append(("boom", None))
        raise ValueError("the batch names iteration 7")

    @op
    def slow(self, seconds: float, fail: bool = False):
        time.sleep(seconds)
        if fail:
            raise RuntimeError(f"failed after {seconds} s")
        return seconds

    @op
    def weights(self, version: int, body: bytes = b""):
        self.seen.append(("weights", bytes(body)))
        return {"version": version, "bytes": len(body)}


def start(tmp_path, **settings):
    host = Recorder()
    settings = {"token": TOKEN, "root": str(tmp_path / "run"), "digest": "d1", **settings}
    server = Server(host, Settings(**settings))
    out = {}
    thread = threading.Thread(target=lambda: out.update(reason=server.serve()), daemon=True)
    thread.start()
    return server, host, thread, out


def client(server, **kw) -> ServiceClient:
    return ServiceClient(server.url, **{"token": TOKEN, "label": "the actor trainer service", "digest": "d1", **kw})


def test_ops_the_token_a_failed_op_the_body_and_the_stop_op(tmp_path):
    server, host, thread, out = start(tmp_path)
    batch = str(tmp_path / "run" / "iter-000003" / "score.arrow")
    assert client(server).score(state={"iteration": 3}, batch=batch) == {"n": 1, "iteration": 3}
    with pytest.raises(ServiceError, match=r"the actor trainer service at .*: boom returned 500: ValueError: the "
                                           r"batch names iteration 7") as err:
        client(server).call("boom")
    assert err.value.status == 500
    with pytest.raises(ServiceError, match="boom returned 401: Unauthorized: bearer token missing or wrong"):
        client(server, token="wrong").call("boom")
    assert client(server).call("weights", {"version": 3}, body=b"\x00\x01tensors") == {"version": 3, "bytes": 9}
    assert host.seen == [("score", batch), ("boom", None), ("weights", b"\x00\x01tensors")]  # 401: never ran
    assert client(server).call("stop", {"reason": "the run ended"}) == {"stopped": "the run ended"}
    thread.join(5)
    assert out["reason"] == "the run ended"
    server.close()
    with pytest.raises(ServiceGone, match=r"the actor trainer service at .* does not answer \(score: connection "
                                          r"refused, 1 attempt\)\. It was killed"):
        client(server, gone_hint="It was killed.").score(state={}, batch=batch)


@pytest.mark.parametrize("op, args, digest, status, message", [
    ("update", {}, "d1", 404, r"has no op 'update' \(its ops: boom, health, score, slow, weights\)"),
    ("score", {"state": {"iteration": 0}, "batch": "{run}/b.arrow", "cfg": {"run": {}}}, "d1", 422,
     r"op score takes no argument 'cfg' \(it takes state, batch\): a request carries only what changes"),
    ("score", {"state": {}}, "d1", 422, r"op score needs the argument 'batch'"),
    ("boom", {}, "d1", 422, r"op boom takes no argument 'body'"),
    ("score", {"state": {}, "batch": "{tmp}/other/b.arrow"}, "d1", 403, r"batch '.*/other/b.arrow' is outside"),
    ("score", {"state": {"actor_url": "s3://bucket/x"}, "batch": "{run}/b"}, "d1", 403, r"state.actor_url 's3://"),
    ("score", {"state": {}, "batch": "{run}/../escape"}, "d1", 403, r"is outside .*reads and writes only inside it"),
    ("score", {"state": {}, "batch": "{run}"}, "d1", 403, r"is outside"),  # strictly inside
    ("score", {"state": {}, "batch": "{run}/b"}, "d0", 409, r"serves the config it started with \(digest d1\); the "
                                                            r"request was sent for another \(d0\)"),
])
def test_a_request_the_layer_refuses_never_reaches_the_host(tmp_path, op, args, digest, status, message):
    server, host, _, _ = start(tmp_path)
    args = json.loads(json.dumps(args).replace("{run}", str(tmp_path / "run")).replace("{tmp}", str(tmp_path)))
    with pytest.raises(ServiceError, match=message) as err:
        client(server, digest=digest).call(op, args, body=b"x" if op == "boom" else None)
    assert err.value.status == status and host.seen == []
    server.stop("done")
    server.close()


def test_the_guard_answers_before_reading_a_request(tmp_path):
    server, host, _, _ = start(tmp_path, max_body_bytes=100)

    def post(data, headers):
        request = urllib.request.Request(server.url + "/call", data=data, method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}", **headers})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    assert post(b"{}", {"Content-Length": "abc"})[0] == 400
    assert post(b" " * 150, {})[0] == 413
    assert "exceeds the limit of 100 bytes" in post(b" " * 150, {})[1]["error"]
    assert post(b"not json", {})[0] == 400
    host_port = server.url.split("//")[1].split(":")
    with socket.create_connection((host_port[0], int(host_port[1])), timeout=10) as raw:  # no Content-Length
        raw.sendall(f"POST /call HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Transfer-Encoding: chunked\r\n\r\n".encode())
        assert raw.recv(100).startswith(b"HTTP/1.0 411")
    assert host.seen == []
    server.stop("done")
    server.close()


def test_many_clients_connecting_at_once_all_get_through(tmp_path):
    """Sixteen clients of a reward server connect at once: with socketserver's listen backlog of 5, Linux dropped
    the handshakes past the fifth waiting connection (a 1 s retransmit, or a reset: lost requests in bench_server)."""
    server, _, _, _ = start(tmp_path)
    server.httpd.shutdown()  # nothing accepts: every connection waits in the listen queue
    address = server.url.split("//")[1].rsplit(":", 1)
    waiting = []
    try:
        for _ in range(64):
            waiting.append(socket.create_connection((address[0], int(address[1])), timeout=0.5))
    except OSError as err:
        pytest.fail(f"connection {len(waiting) + 1} of 64 waiting for accept() failed: {err!r}")
    finally:
        for s in waiting:
            s.close()
        server.stop("done")
        server.close()


def test_idle_timeout_and_a_gone_parent_stop_the_service(tmp_path):
    server, _, thread, out = start(tmp_path, idle_timeout_s=0.5)
    thread.join(10)
    assert "no request for 0.5 s" in out["reason"]
    server.close()
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait()
    server, _, thread, out = start(tmp_path, parent_pid=parent.pid)
    thread.join(10)
    assert out["reason"] == f"the run's process {parent.pid} is gone"
    server.close()


def test_the_address_book_finds_a_launch_s_own_service_and_stops_only_those(tmp_path, monkeypatch):
    """On a cluster the services start beside the first tasks: a caller waits for an address of its own launch,
    never an earlier one's; the stop at the run's end reaches the published services of its launch only (with the
    token derived for each), and removes their addresses."""
    monkeypatch.setenv(SECRET_ENV, "the-run-secret")
    run = str(tmp_path / "r1")
    with pytest.raises(ServiceGone, match=r"the engine service of the run at .*r1 has not published an address"):
        book.find(run, "engine", "exec-new", label="the engine service")
    book.publish(run, book.ServiceAddress("engine", "http://127.0.0.1:1", 41, "exec-old"))
    with pytest.raises(ServiceGone, match=r"belongs to launch 'exec-old', not to this one \('exec-new'\).*"
                                          r"run.resident_start_timeout_s"):
        book.find(run, "engine", "exec-new", wait_s=1.5)
    server, _, thread, out = start(tmp_path, token=service_token(run, "exec-new", "engine"), root="", digest="")
    later = threading.Timer(0.5, book.publish, (run, book.ServiceAddress("engine", server.url, 42, "exec-new")))
    later.start()
    assert book.find(run, "engine", "exec-new", wait_s=10).pid == 42  # waited for it
    book.publish(run, book.ServiceAddress("critic", "http://127.0.0.1:1", 43, "exec-other"))
    assert book.stop_published(run, "exec-new", ("engine", "actor", "critic"), "the run finished") == ["engine"]
    thread.join(5)
    assert out["reason"] == "the run finished" and server.requests == 1
    assert book.read(run, "engine") is None and book.read(run, "critic").launch == "exec-other"
    server.close()


def test_an_address_removed_as_it_is_read_reads_as_none(tmp_path, monkeypatch):
    """A caller polling the book while a service unpublishes (a restart, the run's end) sees no address, never a
    FileNotFoundError: the address is gone between a check that it exists and its read (found by test_resume)."""
    from models import storage

    run = str(tmp_path / "r1")
    book.publish(run, book.ServiceAddress("engine", "http://127.0.0.1:1", 41, "exec-1"))
    read_json = storage.read_json

    def unpublished_first(url, *args, **kwargs):
        book.unpublish(run, "engine")  # the service goes just before the read
        return read_json(url, *args, **kwargs)

    monkeypatch.setattr(storage, "read_json", unpublished_first)
    assert book.read(run, "engine") is None


def test_the_loop_runs_each_request_on_every_rank():
    """A trainer service's ranks: rank 0's requests reach the others (``share``), each rank runs the same ops."""
    requests = [("score", {"state": {"iteration": 1}, "batch": "b"}, None), ("stop", {"reason": "end"}, None)]
    host = Recorder()
    assert serve_ranks(host, None, lambda _: requests.pop(0), print) == "end"
    assert host.seen == [("score", "b")]


def test_the_client_backs_off_and_names_a_refused_port():
    with pytest.raises(ValueError, match="retries >= 0"):
        ServiceClient("http://x", retries=-1)
    c = ServiceClient("http://127.0.0.1:1/", label="reward server", retries=2, backoff_s=0.05, max_backoff_s=0.08)
    assert [c.delay_s(k) for k in (1, 2, 3)] == [0.05, 0.08, 0.08] and c.url == "http://127.0.0.1:1"
    with pytest.raises(ServiceGone) as err:
        c.call("health")
    assert str(err.value) == "reward server at http://127.0.0.1:1 does not answer (health: connection refused, " \
                             "3 attempts)."
    assert err.value.attempts == 3


@pytest.mark.integration  # waits out its deadlines (3 s)
def test_a_long_op_shows_life_and_a_silent_service_fails_its_caller_within_the_deadline(tmp_path):
    """With heartbeats (a run's services) the deadline bounds a silence, not an op: an op three times longer than
    it answers, its error keeps its status and kind; a service that accepts the request and then says nothing
    fails the call after the deadline, naming it."""
    server, host, _, _ = start(tmp_path)
    beating = client(server, timeout_s=0.4, heartbeat=True)
    assert beating.call("slow", {"seconds": 1.2}) == 1.2
    with pytest.raises(ServiceError, match=r"slow returned 500: RuntimeError: failed after 0.6 s") as err:
        beating.call("slow", {"seconds": 0.6, "fail": True})
    assert (err.value.status, err.value.kind) == (500, "RuntimeError")
    with pytest.raises(ServiceError, match=r"slow timed out after 0.4 s"):  # the same op without heartbeats
        client(server, timeout_s=0.4).call("slow", {"seconds": 0.6})
    server.stop("done")
    server.close()

    mute = socket.create_server(("127.0.0.1", 0))  # takes the connection, never answers: a hung service
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=r"the actor trainer service at .*: score timed out after 0.3 s without "
                                           r"an answer or a sign of life"):
        ServiceClient(f"http://127.0.0.1:{mute.getsockname()[1]}", TOKEN, "the actor trainer service",
                      timeout_s=0.3, heartbeat=True).call("score", {})
    assert time.monotonic() - t0 < 5
    mute.close()
