"""plait.parallel.replicas.transport: a replica's state between two SafeTransports over real HTTP on loopback.

A round trip keeps every tensor's values, dtype and shape and every scalar's type; a table of crafted payloads
(pickles, torch.save files, truncated and oversized bodies, safetensors files whose tree or tensors do not fit
this replica) is each refused with a HealRefused naming the field, and nothing in them is executed; the server
serves only the staged step, only between send_checkpoint and disallow_checkpoint."""

from __future__ import annotations

import copy
import http.client
import http.server
import io
import json
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from safetensors.torch import save as save_safetensors  # noqa: E402

from plait.core.errors import ArgumentError  # noqa: E402
from plait.parallel.replicas import FORMAT, HealRefused, SafeTransport, serialize_state  # noqa: E402

TIMEOUT = timedelta(seconds=5)
STEP = 7


def state(**change) -> dict:
    """A state in the shape torchft's Manager sends: model and optimizer in float32, bfloat16 and int64, scalars
    of each kind, None, nested lists and tuples, an int key; `change` replaces a leaf of the model by name."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g)
    model = {
        "layers.0.w": w,
        "layers.0.w_t": w.t(),  # not contiguous, and shares w's storage
        "layers.0.row": w[2],  # a view into w
        "emb": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    model.update(change)
    opt = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(8, 8)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "fused": None, "name": "all", "amsgrad": False}],
    }
    data = {"position": [[0, 12], [1, 40]], "epoch": 2}
    return {
        "user": {"default": {"model": model, "optim": opt, "data": data}},
        "torchft": {"step": STEP, "batches_committed": 28},
    }


def assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert type(got) is type(want) and got == want


@pytest.fixture
def pair() -> Iterator[tuple[SafeTransport, SafeTransport]]:
    """A live peer and a restarted replica whose template is `state()`."""
    peer = SafeTransport(timeout=TIMEOUT, host="127.0.0.1")
    replica = SafeTransport(timeout=TIMEOUT, host="127.0.0.1", template=state)
    yield peer, replica
    peer.shutdown()
    replica.shutdown()


def test_round_trip_keeps_every_value_dtype_and_type(pair):
    peer, replica = pair
    sent = state()
    peer.send_checkpoint([1], STEP, sent, TIMEOUT)
    got = replica.recv_checkpoint(0, peer.metadata(), STEP, TIMEOUT)
    assert_same(got, sent)
    assert got["user"]["default"]["model"]["emb"].dtype == torch.bfloat16
    got["user"]["default"]["model"]["layers.0.w"].add_(1)  # writable, and its own memory
    assert not torch.equal(
        got["user"]["default"]["model"]["layers.0.w"], sent["user"]["default"]["model"]["layers.0.w"]
    )


def test_the_state_may_change_once_sent(pair):
    """send_checkpoint copies: torchft lets the trainer step on once disallow_checkpoint returns."""
    peer, replica = pair
    sent = state()
    peer.send_checkpoint([1], STEP, sent, TIMEOUT)
    before = copy.deepcopy(sent)
    sent["user"]["default"]["model"]["layers.0.w"].mul_(0)
    assert_same(replica.recv_checkpoint(0, peer.metadata(), STEP, TIMEOUT), before)


def test_a_receiver_that_asks_before_the_peer_stages_waits_for_it(pair):
    """torchft lets a healing replica fetch as soon as the quorum is known, maybe before the peer has staged."""
    peer, replica = pair
    timer = threading.Timer(0.3, peer.send_checkpoint, ([1], STEP, state(), TIMEOUT))
    timer.start()
    assert_same(replica.recv_checkpoint(0, peer.metadata(), STEP, TIMEOUT), state())
    timer.join()


def test_what_cannot_heal_is_refused_at_the_sender(pair):
    peer, _ = pair
    with pytest.raises(ArgumentError, match=r"user/default/lr is a PosixPath: only dicts"):
        peer.send_checkpoint([1], STEP, {"user": {"default": {"lr": Path("x")}}}, TIMEOUT)
    with pytest.raises(ArgumentError, match="a key of type float"):
        peer.send_checkpoint([1], STEP, {"user": {1.5: 1}}, TIMEOUT)


# ---- the server's rules ----


def get(url: str, path: str) -> int:
    host, port = url.split("/")[2].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_server_serves_only_the_staged_step_between_send_and_disallow(pair):
    peer, replica = pair
    url = peer.metadata()
    assert get(url, "/heal/7") == 503  # nothing staged yet
    peer.send_checkpoint([1], STEP, state(), TIMEOUT)
    assert get(url, "/heal/7") == 200
    assert get(url, "/heal/8") == 409
    assert get(url, "/heal/x") == get(url, "/other/7") == get(url, "/") == 404
    with pytest.raises(HealRefused, match=r"^healing from http://127.0.0.1:\d+/heal/: the peer answered 409"):
        replica.recv_checkpoint(0, url, 8, TIMEOUT)
    peer.disallow_checkpoint()
    assert get(url, "/heal/7") == 503
    start = time.monotonic()
    with pytest.raises(HealRefused, match="the peer answered 503 for step 7"):
        replica.recv_checkpoint(0, url, STEP, timedelta(seconds=0.5))
    assert time.monotonic() - start < 1.0


def test_shutdown_stops_the_server():
    peer = SafeTransport(timeout=TIMEOUT, host="127.0.0.1")
    url = peer.metadata()
    peer.shutdown()
    peer.shutdown()  # a second call is harmless
    with pytest.raises(ConnectionRefusedError):
        get(url, "/heal/7")


# ---- crafted payloads ----


class Marker:
    """Unpickling this creates its file: a payload that would run code if anything unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def tree_file(tree: object, tensors: dict | None = None, fmt: str = FORMAT) -> bytes:
    text = tree if isinstance(tree, str) else json.dumps(tree)
    return save_safetensors(tensors or {}, metadata={"format": fmt, "tree": text})


def torch_saved(_: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(state(), buf)
    return buf.getvalue()


def with_step(step: int) -> dict:
    sent = state()
    sent["torchft"]["step"] = step
    return sent


def with_extra_key() -> dict:
    sent = state()
    sent["user"]["default"]["optim"]["param_groups"][0]["foreach"] = True
    return sent


def without_key() -> dict:
    sent = state()
    del sent["user"]["default"]["model"]["ids"]
    return sent


def changed(change: Callable[[dict], object]) -> bytes:
    sent = state()
    change(sent)
    return serialize_state(sent)


def manager_part(user_tree: dict) -> dict:
    return {
        "dict": [
            ["user", user_tree],
            ["torchft", {"dict": [["step", {"value": STEP}], ["batches_committed", {"value": 0}]]}],
        ]
    }


M = "user/default/model"
CRAFTED: list[tuple[str, Callable[[Path], bytes], str, str]] = [
    ("pickle", lambda p: pickle.dumps({"user": Marker(p / "marker")}), "the payload", "not a safetensors file"),
    ("torch.save", torch_saved, "the payload", "not a safetensors file"),
    ("truncated", lambda p: (b := serialize_state(state()))[: len(b) - 10], "the payload", "not a safetensors file"),
    ("truncated header", lambda p: serialize_state(state())[:100], "the payload", "not a safetensors file"),
    ("empty", lambda p: b"", "the payload", "not a safetensors file"),
    ("shape", lambda p: serialize_state(state(**{"layers.0.w": torch.zeros(4, 8)})), f"{M}/layers.0.w",
     "has shape (4, 8), this replica's is (8, 8)"),
    ("dtype", lambda p: serialize_state(state(ids=torch.arange(5, dtype=torch.int32))), f"{M}/ids",
     "has dtype torch.int32, this replica's is torch.int64"),
    ("missing key", lambda p: serialize_state(without_key()), f"{M}/ids", "is missing"),
    ("extra key", lambda p: serialize_state(with_extra_key()), "user/default/optim/param_groups/0/foreach",
     "is not in this replica's state"),
    ("scalar type", lambda p: changed(lambda s: s["user"]["default"]["data"].update(epoch="2")),
     "user/default/data/epoch", "is a str, this replica's is a int"),
    ("list length", lambda p: changed(lambda s: s["user"]["default"]["data"]["position"].pop()),
     "user/default/data/position", "has 1 items, this replica's has 2"),
    ("tensor for a scalar", lambda p: changed(lambda s: s["user"]["default"]["data"].update(epoch=torch.ones(1))),
     "user/default/data/epoch", "is a tensor, this replica's is a int"),
    ("nan", lambda p: serialize_state(state(emb=torch.full((16, 4), float("nan"), dtype=torch.bfloat16))), f"{M}/emb",
     "NaN or infinite"),
    ("inf", lambda p: serialize_state(state(**{"layers.0.w": torch.full((8, 8), float("inf"))})), f"{M}/layers.0.w",
     "NaN or infinite"),
    ("wrong step", lambda p: serialize_state(with_step(6)), "torchft/step", "is 6, but step 7 was asked for"),
    ("step not int", lambda p: serialize_state(with_step(True)), "torchft/step", "not a count"),  # type: ignore[arg-type]
    ("no torchft part", lambda p: serialize_state({"user": {}}), "torchft", "is missing"),
    ("not plait's format", lambda p: tree_file({"value": 1}, fmt="other/1"), "the payload", "not a plait-heal/1 state"),
    ("plain safetensors", lambda p: save_safetensors({"w": torch.ones(2)}), "the payload", "not a plait-heal/1 state"),
    ("tree not JSON", lambda p: tree_file("{not json"), "the payload's tree", "is not JSON"),
    ("tree too deep", lambda p: tree_file("[" * 100000 + "]" * 100000), "the payload's tree", "is not JSON"),
    ("tree nests too far", lambda p: tree_file(_deep(80)), "user/default" + "/0" * 63, "nests deeper"),
    ("tree not a node", lambda p: tree_file(manager_part({"value": 1, "tensor": "w"})), "user", "is not a node"),
    ("tree of a kind unknown", lambda p: tree_file(manager_part({"weird": 1})), "user", "which the format lacks"),
    ("tree of unknown kind", lambda p: tree_file({"pickle": "x"}), "the payload's tree", "which the format lacks"),
    ("bad dict entry", lambda p: tree_file(manager_part({"dict": [[1.5, {"value": 1}]]})), "user", "[key, node] pair"),
    ("duplicate key", lambda p: tree_file(manager_part({"dict": [["a", {"value": 1}], ["a", {"value": 2}]]})), "user",
     "[key, node] pair"),
    ("names a missing tensor", lambda p: tree_file(manager_part({"dict": [["w", {"tensor": "nope"}]]})), "user/w",
     "the file does not hold once"),
    ("names a tensor twice", lambda p: tree_file(manager_part({"list": [{"tensor": "w"}, {"tensor": "w"}]}),
     {"w": torch.ones(1)}), "user/1", "the file does not hold once"),
    ("a tensor no node names", lambda p: tree_file(manager_part({"dict": []}), {"hidden": torch.ones(1)}), "hidden",
     "its tree does not name"),
    ("not the Manager's shape", lambda p: tree_file({"list": []}), "the state", "is a list, not torchft's"),
]  # fmt: skip


def _deep(levels: int) -> dict:
    node: dict = {"value": 1}
    for _ in range(levels):
        node = {"list": [node]}
    return manager_part({"dict": [["default", node]]})


@contextmanager
def serving(body: bytes, *, length: int | None | str = "honest") -> Iterator[str]:
    """A bare HTTP server answering every GET with `body`, its Content-Length honest, another number, or left
    out (the body then ends when the connection closes); yields a metadata() URL for it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            if length is not None:
                self.send_header("Content-Length", str(len(body) if length == "honest" else length))
            self.end_headers()
            with suppress(OSError):  # a refusing reader closes early
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/heal/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def replica() -> Iterator[SafeTransport]:
    transport = SafeTransport(timeout=TIMEOUT, host="127.0.0.1", template=state)
    yield transport
    transport.shutdown()


@pytest.mark.parametrize(("build", "field", "words"), [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_a_crafted_payload_is_refused_naming_its_field(replica, tmp_path, build, field, words):
    with serving(build(tmp_path)) as url, pytest.raises(HealRefused) as refused:
        replica.recv_checkpoint(0, url, STEP, TIMEOUT)
    assert (refused.value.url, refused.value.field) == (url, field)
    assert words in refused.value.problem and "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"healing from {url}: {field} ")
    assert not (tmp_path / "marker").exists()


def test_the_marker_would_be_written_by_unpickling(tmp_path):
    """The pickle case's control: its bytes do run code when unpickled, so its file's absence above means something."""
    pickle.loads(pickle.dumps(Marker(tmp_path / "marker")))
    assert (tmp_path / "marker").exists()


def test_the_template_itself_passes_and_without_one_only_the_manager_part_is_checked(tmp_path):
    loose = SafeTransport(timeout=TIMEOUT, host="127.0.0.1")
    try:
        with serving(serialize_state(state(**{"layers.0.w": torch.zeros(4, 8)}))) as url:
            got = loose.recv_checkpoint(0, url, STEP, TIMEOUT)
        assert got["user"]["default"]["model"]["layers.0.w"].shape == (4, 8)
        with serving(serialize_state(with_step(6))) as url, pytest.raises(HealRefused, match="torchft/step is 6"):
            loose.recv_checkpoint(0, url, STEP, TIMEOUT)
    finally:
        loose.shutdown()


def test_large_finite_values_are_not_taken_for_infinite(replica):
    """The finiteness check sums first; a sum that overflows on finite values must not refuse them."""
    sent = state(**{"layers.0.w": torch.full((8, 8), 3e38)})
    with serving(serialize_state(sent)) as url:
        assert_same(replica.recv_checkpoint(0, url, STEP, TIMEOUT), sent)


@pytest.mark.parametrize("length", ["honest", None, "999999999"], ids=["told", "untold", "lied"])
def test_a_payload_over_max_bytes_is_refused(length):
    small = SafeTransport(timeout=TIMEOUT, host="127.0.0.1", max_bytes=10_000)
    try:
        with serving(b"x" * 50_000, length=length) as url, pytest.raises(HealRefused) as refused:
            small.recv_checkpoint(0, url, STEP, TIMEOUT)
        assert refused.value.field == "the payload" and "limit of 10000" in refused.value.problem
    finally:
        small.shutdown()


def test_the_template_bounds_what_is_read(replica):
    """With a template, a payload far larger than its tensors is refused before it is read (Content-Length)."""
    with serving(b"", length=str(1 << 40)) as url, pytest.raises(HealRefused, match="more than the limit"):
        replica.recv_checkpoint(0, url, STEP, TIMEOUT)


def test_a_body_shorter_than_its_length_is_refused(replica):
    body = serialize_state(state())
    with serving(body, length=str(len(body) + 100)) as url, pytest.raises(HealRefused, match="was cut short"):
        replica.recv_checkpoint(0, url, STEP, TIMEOUT)


@pytest.mark.parametrize(
    "metadata",
    ["file:///etc/passwd", "ftp://127.0.0.1:21/heal/", "https://127.0.0.1:1/heal/", "garbage", "", "http://127.0.0.1/heal/",
     "http://user:pw@127.0.0.1:1/heal/", "http://127.0.0.1:99999/heal/", "http://127.0.0.1:1/heal/?x=1",
     "http://127.0.0.1:1/he al/", "http://127.0.0.1:1/heal/\nHost: evil", None],
)  # fmt: skip
def test_a_metadata_that_is_not_an_http_address_is_refused(replica, metadata):
    with pytest.raises(HealRefused) as refused:
        replica.recv_checkpoint(0, metadata, STEP, TIMEOUT)
    assert refused.value.field == "the metadata" and "\n" not in str(refused.value)


def test_a_peer_that_never_answers_times_out():
    """A socket that accepts connections and never replies: the call returns within about twice its timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    transport = SafeTransport(timeout=TIMEOUT, host="127.0.0.1")
    try:
        start = time.monotonic()
        with pytest.raises(HealRefused, match=r"the peer did not answer within 0.3 s"):
            transport.recv_checkpoint(
                0, f"http://127.0.0.1:{silent.getsockname()[1]}/heal/", STEP, timedelta(seconds=0.3)
            )
        assert time.monotonic() - start < 0.6
    finally:
        transport.shutdown()
        silent.close()


def test_a_refusal_pickles_whole():
    refused = HealRefused("http://h:1/heal/", "user/w", "is missing")
    again = pickle.loads(pickle.dumps(refused))
    assert str(again) == str(refused) == "healing from http://h:1/heal/: user/w is missing"
