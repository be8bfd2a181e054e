"""A torchft checkpoint transport that moves a replica's state as data, never as code.

torchft's Manager heals a restarted replica group from a live peer: the peer calls `send_checkpoint(dst_ranks,
step, state_dict, timeout)` with `{"user": {key: state}, "torchft": {"step", "batches_committed"}}`, the healing
one `recv_checkpoint(src_rank, metadata, step, timeout)` with the peer's `metadata()`, and the peer's
`should_commit` calls `disallow_checkpoint()` before its state changes. torchft's own transports unpickle.

Here the state is one safetensors file (whose header safetensors checks before it maps a byte): each tensor an
entry named by its path ("user/model/layers.0.w"), the tree (dicts with str or int keys, lists, tuples, and
int/float/str/bool/None leaves) one JSON string in its metadata. The receiver parses it, then checks it against
`template` (its own state): a missing or extra key, another shape, dtype or scalar type, a non-finite float, a
step other than the one asked for is a `HealRefused` naming the peer, the field and the fault. The `metadata()`
came over the network too: only `http://HOST:PORT/PATH` is fetched, with http.client (no redirects or proxies).

The sender serves one step's bytes from a small HTTP server (a daemon thread, an ephemeral port) only between
`send_checkpoint` and `disallow_checkpoint`; outside that it answers 503 and the receiver asks again until its
timeout, since torchft lets a healing replica fetch as soon as the quorum is known, maybe before the peer has
staged. Another step gets 409 at once."""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.tensor import DTensor
from torchft.checkpointing.transport import CheckpointTransport

from plait.core.errors import ArgumentError, PlaitError

logger = logging.getLogger(__name__)

FORMAT = "plait-heal/1"
"""The value of the safetensors metadata's "format": a receiver refuses any other."""
DEFAULT_MAX_BYTES = 64 << 30
"""The largest payload a receiver reads when it is given no template (with one, the template's size bounds it)."""
_HEADER_SLACK = 100 << 20  # safetensors' own limit on a header, so the tree's JSON always fits beside the tensors
_MAX_DEPTH = 64  # nesting of a state dict; a deeper tree from a peer is refused, not recursed into
_CHUNK = 1 << 20
_PATH = re.compile(r"[A-Za-z0-9/_.~-]*")
_SCALARS = (type(None), bool, int, float, str)


class HealRefused(PlaitError):
    """A peer's state was not taken: it is malformed or does not fit this replica's. `args` is (url, field,
    problem), so the error pickles; `str()` is the one line."""

    def __init__(self, url: str, field: str, problem: str) -> None:
        super().__init__(url, field, problem)
        self.url, self.field, self.problem = url, field, problem

    def __str__(self) -> str:
        return f"healing from {self.url}: {self.field} {self.problem}"


def _refuse(field: str, problem: str) -> NoReturn:
    """Refuse with no URL yet: `recv_checkpoint` raises it again with the peer's."""
    raise HealRefused("", field, problem)


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


# ---- the sending side: a state dict to safetensors bytes ----


def _plain_tensor(t: torch.Tensor, path: str, seen: set[int]) -> torch.Tensor:
    """`t` as a CPU, contiguous tensor with a storage no other entry uses (safetensors refuses shared ones)."""
    if isinstance(t, DTensor):
        raise ArgumentError(f"{path} is a DTensor: pass its local shard (DTensor.to_local()) to heal a replica")
    t = t.detach().to("cpu").contiguous()
    if t.numel() and t.untyped_storage().data_ptr() in seen:
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t


def _encode(node: Any, path: str, tensors: dict[str, torch.Tensor], seen: set[int]) -> Any:
    """The JSON tree of `node`; each tensor leaf goes into `tensors` under its path and the tree names it."""
    if isinstance(node, torch.Tensor):
        name = path if path and path not in tensors else f"{path}#{len(tensors)}"
        tensors[name] = _plain_tensor(node, path or "the state", seen)
        return {"tensor": name}
    if isinstance(node, dict):
        items = []
        for key, value in node.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise ArgumentError(f"{_join(path, key)}: a key of type {type(key).__name__}; only str and int heal")
            items.append([key, _encode(value, _join(path, key), tensors, seen)])
        return {"dict": items}
    if isinstance(node, list | tuple):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode(v, _join(path, i), tensors, seen) for i, v in enumerate(node)]}
    if isinstance(node, _SCALARS):
        return {"value": node}
    raise ArgumentError(
        f"{path or 'the state'} is a {type(node).__name__}: only dicts, lists, tuples, tensors and "
        "int/float/str/bool/None heal; turn it into one of those in its state_dict()"
    )


def serialize_state(state_dict: dict[str, Any]) -> bytes:
    """`state_dict` as one safetensors file: the tensors as entries, the tree as JSON in its metadata."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state_dict, "", tensors, set())
    return save_safetensors(tensors, metadata={"format": FORMAT, "tree": json.dumps(tree)})


# ---- the receiving side: bytes from a peer to a checked state dict ----


def _tree_metadata(data: bytes) -> Any:
    """The tree's JSON from a file safetensors has already checked (its header length and JSON are sound)."""
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or not isinstance(meta.get("tree"), str):
        _refuse("the payload", f"is a safetensors file but not a {FORMAT} state (no such format in its metadata)")
    try:
        return json.loads(meta["tree"])
    except (ValueError, RecursionError) as e:
        _refuse("the payload's tree", f"is not JSON ({type(e).__name__}: {str(e)[:80]})")


def _decode(node: Any, path: str, tensors: dict[str, torch.Tensor], used: set[str], depth: int) -> Any:
    """The state a tree names, every node of it checked: the peer wrote it and may have written anything."""
    field = path or "the payload's tree"
    if depth > _MAX_DEPTH:
        _refuse(field, f"nests deeper than {_MAX_DEPTH} levels")
    if not isinstance(node, dict) or len(node) != 1:
        _refuse(field, "is not a node of the tree (one of tensor, dict, list, tuple, value)")
    ((kind, body),) = node.items()
    if kind == "tensor":
        if not isinstance(body, str) or body not in tensors or body in used:
            _refuse(field, f"names a tensor the file does not hold once: {body!r:.80}")
        used.add(body)
        t = tensors[body]
        if (t.is_floating_point() or t.is_complex()) and not _all_finite(t):
            _refuse(field, "holds NaN or infinite values")
        return t
    if kind == "dict" and isinstance(body, list):
        out: dict[str | int, Any] = {}
        for item in body:
            ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str | int)
            if not ok or isinstance(item[0], bool) or item[0] in out:
                _refuse(field, f"has an entry that is not a [key, node] pair with a new str or int key: {item!r:.80}")
            out[item[0]] = _decode(item[1], _join(path, item[0]), tensors, used, depth + 1)
        return out
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [_decode(v, _join(path, i), tensors, used, depth + 1) for i, v in enumerate(body)]
        return items if kind == "list" else tuple(items)
    if kind == "value" and isinstance(body, _SCALARS):
        if isinstance(body, float) and math.isnan(body):
            _refuse(field, "is NaN")
        return body
    _refuse(field, f"is a {kind!r:.40} node with a body of type {type(body).__name__}, which the format lacks")


def _all_finite(t: torch.Tensor) -> bool:
    """A NaN or an infinity makes a sum NaN or infinite, so a finite sum clears the tensor in one cheap pass; the
    element-wise test runs only when the sum is not (large finite values can overflow it too)."""
    total = t.sum() if t.is_complex() else t.sum(dtype=torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def _kind(x: Any) -> str:
    return "tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _check(got: Any, want: Any, path: str) -> None:
    """Refuse the first difference of `got` (the peer's) from `want` (this replica's) in tree, shape, dtype or
    scalar type. Lists and tuples count as one kind (a reload may turn one into the other); values are not
    compared, only what they are."""
    field = path or "the state"
    if isinstance(want, torch.Tensor):
        if isinstance(want, DTensor):
            raise ArgumentError(f"the template's {field} is a DTensor: give its local shard, as the sender does")
        if not isinstance(got, torch.Tensor):
            _refuse(field, f"is a {_kind(got)}, this replica's is a tensor")
        if got.shape != want.shape:
            _refuse(field, f"has shape {tuple(got.shape)}, this replica's is {tuple(want.shape)}")
        if got.dtype != want.dtype:
            _refuse(field, f"has dtype {got.dtype}, this replica's is {want.dtype}")
    elif isinstance(want, dict):
        if not isinstance(got, dict):
            _refuse(field, f"is a {_kind(got)}, this replica's is a dict")
        for key in [*want, *got]:
            if key not in got or key not in want:
                _refuse(_join(path, key), "is missing" if key not in got else "is not in this replica's state")
        for key, value in want.items():
            _check(got[key], value, _join(path, key))
    elif isinstance(want, list | tuple):
        if not isinstance(got, list | tuple):
            _refuse(field, f"is a {_kind(got)}, this replica's is a {_kind(want)}")
        if len(got) != len(want):
            _refuse(field, f"has {len(got)} items, this replica's has {len(want)}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _check(g, w, _join(path, i))
    elif type(got) is not type(want):
        _refuse(field, f"is a {_kind(got)}, this replica's is a {_kind(want)}")


def _check_manager_part(state: Any, step: int) -> None:
    """The part torchft's Manager reads itself: {"user": dict, "torchft": {"step": step, "batches_committed"}}."""
    if not isinstance(state, dict):
        _refuse("the state", f"is a {_kind(state)}, not torchft's {{'user': ..., 'torchft': ...}}")
    if not isinstance(state.get("user"), dict):
        _refuse("user", "is missing or not a dict")
    manager = state.get("torchft")
    if not isinstance(manager, dict):
        _refuse("torchft", "is missing or not a dict")
    for key in ("step", "batches_committed"):
        if type(manager.get(key)) is not int or manager[key] < 0:
            _refuse(f"torchft/{key}", f"is {manager.get(key)!r:.40}, not a count")
    if manager["step"] != step:
        _refuse("torchft/step", f"is {manager['step']}, but step {step} was asked for")


def _parse_state(data: bytes, step: int, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state a peer sent for `step`, checked against `template` where given; raises HealRefused otherwise."""
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # safetensors' errors have no common base beyond this
        _refuse("the payload", f"is not a safetensors file ({type(e).__name__}: {str(e)[:80]})")
    used: set[str] = set()
    state = _decode(_tree_metadata(data), "", tensors, used, 0)
    if extra := sorted(set(tensors) - used):
        _refuse(extra[0], "is a tensor of the file that its tree does not name")
    _check_manager_part(state, step)
    if template is not None:
        _check(state, template, "")
    return state


# ---- the network: the peer's address, the fetch, the server ----


def _peer_address(metadata: str) -> tuple[str, int, str]:
    """(host, port, path) of a peer's `metadata()`: an http://HOST:PORT/PATH address and nothing else."""
    shown = repr(metadata)[:120] if isinstance(metadata, str) else type(metadata).__name__
    if not isinstance(metadata, str) or len(metadata) > 2048 or not metadata.isprintable():
        _refuse("the metadata", f"{shown} is not an http://HOST:PORT/ address")
    parts = urllib.parse.urlsplit(metadata)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.username or parts.password:
        _refuse("the metadata", f"{shown} is not an http://HOST:PORT/ address")
    if parts.query or parts.fragment or not _PATH.fullmatch(parts.path):
        _refuse("the metadata", f"{shown} has a query, fragment or path this transport does not send")
    return parts.hostname, port, parts.path.rstrip("/")


def _read_body(response: http.client.HTTPResponse, deadline: float, limit: int) -> bytes:
    """The body, at most `limit` bytes (checked before and while reading), read before `deadline`."""
    length = response.getheader("Content-Length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        _refuse("the payload", f"is {length:.30} bytes, more than the limit of {limit} (max_bytes)")
    chunks, total = [], 0
    while chunk := response.read(_CHUNK):
        total += len(chunk)
        if total > limit:
            _refuse("the payload", f"is more than the limit of {limit} bytes (max_bytes)")
        if time.monotonic() > deadline:
            _refuse("the payload", f"did not arrive within the timeout ({total} bytes read)")
        chunks.append(chunk)
    if length is not None and total != int(length):
        _refuse("the payload", f"was cut short: {total} of its {length} bytes arrived")
    return b"".join(chunks)


def _fetch_state(metadata: str, step: int, timeout: timedelta, limit: int) -> bytes:
    """The bytes a peer serves for `step`. A 503 (not staged yet) is asked again until the timeout; each read
    waits at most the timeout, so the call returns within about twice it."""
    host, port, base = _peer_address(metadata)
    seconds = timeout.total_seconds()
    deadline, pause = time.monotonic() + seconds, 0.02
    while True:
        conn = http.client.HTTPConnection(host, port, timeout=max(0.01, min(seconds, deadline - time.monotonic())))
        try:
            conn.request("GET", f"{base}/{step}")
            response = conn.getresponse()
            if response.status == 503 and time.monotonic() + pause < deadline:
                time.sleep(pause)
                pause = min(2 * pause, 0.5)
                continue
            if response.status != 200:
                said = response.read(200).decode("ascii", "replace").splitlines()[:1]
                _refuse("the peer", f"answered {response.status} for step {step}: {' '.join(said)!r:.100}")
            return _read_body(response, deadline, limit)
        except TimeoutError:
            _refuse("the peer", f"did not answer within {seconds:g} s")
        except (OSError, http.client.HTTPException) as e:
            _refuse("the peer", f"could not be read ({type(e).__name__}: {str(e)[:80]})")
        finally:
            conn.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET PATH/STEP: the staged bytes when STEP is the staged step."""

    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.transport.timeout.total_seconds())  # a stalled reader frees its thread

    def do_GET(self) -> None:
        status, body = self.server.transport.answer(urllib.parse.urlsplit(self.path).path)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if status == 200 else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError as e:  # the peer gave up (its timeout): nothing of ours to clean up
            logger.info("a healing peer left before its state was sent: %s", e)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("heal server: " + format, *args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, transport: SafeTransport) -> None:
        self.address_family = family
        self.transport = transport
        super().__init__(address, _Handler)


class SafeTransport(CheckpointTransport[dict]):
    """torchft's CheckpointTransport, with safetensors bytes and checks instead of pickle (see the module).

    `timeout` bounds a serving thread's wait on a slow reader; `template`, where given, returns this replica's
    current state in the shape the Manager sends ({"user": {key: state}, "torchft": manager.state_dict()},
    tensors as local shards) and what a peer sends must match it; `max_bytes` bounds what is read when there
    is no template; `host` is the address to bind and to publish (default: all interfaces, published as this
    machine's host name)."""

    def __init__(
        self,
        *,
        timeout: timedelta,
        template: Callable[[], dict] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        host: str | None = None,
    ) -> None:
        self.timeout, self.template, self.max_bytes = timeout, template, max_bytes
        self._lock = threading.Lock()
        self._staged: tuple[int, bytes] | None = None
        self._closed = False
        self._server = _bind(host, self)
        shown = host or socket.gethostname()
        self._url = f"http://{f'[{shown}]' if ':' in shown else shown}:{self._server.server_address[1]}/heal/"
        # A short poll, so that shutdown() returns at once rather than after serve_forever's default half second.
        serve = lambda: self._server.serve_forever(poll_interval=0.05)  # noqa: E731
        self._thread = threading.Thread(target=serve, name="plait-heal-server", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        """The URL a peer fetches from; the step is appended to it."""
        return self._url

    def answer(self, path: str) -> tuple[int, bytes]:
        """The server's reply (status, body) to a GET of `path`."""
        prefix, _, step = path.rpartition("/")
        if prefix != "/heal" or not step.isdigit():
            return 404, b"no such path: GET /heal/STEP\n"
        with self._lock:
            staged = self._staged
        if staged is None:
            return 503, b"no state is being served now\n"
        if int(step) != staged[0]:
            return 409, f"serving step {staged[0]}, not step {step}\n".encode()
        return 200, staged[1]

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        """Serve `state_dict` as step `step` until `disallow_checkpoint`. It is copied into bytes here, so the
        caller may change it as soon as this returns (torchft waits for disallow_checkpoint anyway)."""
        payload = serialize_state(state_dict)
        with self._lock:
            self._staged = (step, payload)

    def disallow_checkpoint(self) -> None:
        """Stop serving; a transfer already under way finishes from its own copy of the bytes."""
        with self._lock:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        """The state a peer serves for `step`, parsed and checked; HealRefused names what was wrong."""
        template = self.template() if self.template is not None else None
        limit = self.max_bytes if template is None else min(self.max_bytes, _tensor_bytes(template) + _HEADER_SLACK)
        shown = metadata if isinstance(metadata, str) and metadata.isprintable() else repr(metadata)[:120]
        try:
            return _parse_state(_fetch_state(metadata, step, timeout, limit), step, template)
        except HealRefused as e:
            raise HealRefused(shown[:200], e.field, e.problem) from None

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server (idempotent); with wait=False the stop finishes in the background."""
        if self._closed:
            return
        self._closed = True
        self.disallow_checkpoint()
        if wait:
            self._stop()
        else:
            threading.Thread(target=self._stop, name="plait-heal-stop", daemon=True).start()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _bind(host: str | None, transport: SafeTransport) -> _Server:
    """A server on an ephemeral port of `host`; with none, of every interface (IPv6 and IPv4, as torchft's)."""
    if host is not None:
        return _Server((host, 0), socket.AF_INET6 if ":" in host else socket.AF_INET, transport)
    try:
        return _Server(("", 0), socket.AF_INET6, transport)
    except OSError:  # no IPv6 on this machine
        return _Server(("", 0), socket.AF_INET, transport)


def _tensor_bytes(node: Any) -> int:
    """Bytes of the tensors in a state tree: what a peer's payload of the same shape holds, less its header."""
    if isinstance(node, torch.Tensor):
        return node.numel() * node.element_size()
    if isinstance(node, dict):
        return sum(_tensor_bytes(v) for v in node.values())
    if isinstance(node, list | tuple):
        return sum(_tensor_bytes(v) for v in node)
    return 0
