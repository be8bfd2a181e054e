"""A directory whose files torch may unpickle or load as native code, trusted only where plait signed them.

torch's compile caches (Inductor's FX-graph and AOTAutograd entries, the mega-cache, compiled kernels) are
pickles and shared objects: whoever can write one runs code in the next process that reads it. A cache kept
in a run directory travels with every copy of the run, and a shared cache directory is writable by others.
So plait never lets torch read such a directory directly:

- the persistent directory (the *store*) carries ``plait-manifest.json``: the SHA-256 and size of every file
  plait put there, and an HMAC-SHA256 of that list under a key only this user can read
  (``~/.config/plait/cache.key``, mode 0600, made on first use; ``PLAIT_KEY_FILE`` names another, e.g. one
  shared by the nodes of a cluster whose home directories differ);
- each process works in a private, fresh directory (mode 0700, under the system temporary directory) and
  torch is pointed only there; before any compile plait copies into it the store's files whose bytes match
  the signed manifest, reading each once (no gap between the check and the use);
- after compiling, the main rank publishes its private directory back into the store (each file written
  atomically, the manifest last).

Anything unsigned, signed with another key, changed or added after signing is never copied: the process
compiles from scratch instead, says so once, and leaves the foreign files where they are (nothing deleted).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import hmac
import json
import os
import shutil
import stat
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from plait.core import storage
from plait.core.storage import Location, RemotePath

MANIFEST = "plait-manifest.json"
KEY_ENV = "PLAIT_KEY_FILE"
_SKIP_SUFFIXES = (".lock", ".tmp")


def key_path() -> Path:
    return Path(os.environ.get(KEY_ENV) or "~/.config/plait/cache.key").expanduser()


def user_key() -> tuple[bytes | None, str]:
    """This user's signing key, made on first use; (None, why) when the key file cannot be trusted."""
    path = key_path()
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")  # mode 0600
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32).hex().encode())
            with contextlib.suppress(FileExistsError):  # another rank made it first: use theirs
                os.link(tmp, path)
            os.unlink(tmp)
        except OSError as e:
            return None, f"the signing key {path} could not be created ({e.strerror or e})"
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            return None, f"the signing key {path} is not a regular file"
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            return None, (
                f"the signing key {path} is not private to this user (mode {stat.S_IMODE(st.st_mode):o}): "
                f"anyone who can read it can forge a cache; chmod 600 {path}"
            )
        key = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        return None, f"the signing key {path} could not be read ({e})"
    if len(key) < 16:
        return None, f"the signing key {path} is too short; delete it and plait makes a new one"
    return key, ""


def _mac(key: bytes, files: dict) -> str:
    body = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _is_safe_relative(rel: str) -> bool:
    p = Path(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and rel != MANIFEST


@dataclass
class CheckoutReport:
    loaded: int = 0
    rejected: list[str] = field(default_factory=list)  # one reason per rejected file or for the whole store
    untrusted_files: int = 0


class TrustedDir:
    """The persistent store at `root`, a local directory or an S3 prefix (plait.core.storage: the nodes of a
    cluster share one): `checkout` copies what verifies into a private directory, `publish` signs and writes a
    private directory back."""

    def __init__(self, root: Location):
        self.root: Location = root if isinstance(root, RemotePath) else Path(root)

    # ------------------------------------------------------------------------------------------ reading

    def checkout(self, dest: Path) -> CheckoutReport:
        report = CheckoutReport()
        present = self._stored()
        if not present:
            return report
        key, why = user_key()
        if key is None:
            report.rejected.append(why)
            report.untrusted_files = len(present)
            return report
        try:
            manifest = json.loads(storage.read_bytes(self.root / MANIFEST))
            files, mac = manifest["files"], manifest["mac"]
            if not isinstance(files, dict) or not isinstance(mac, str):
                raise ValueError("malformed")
        except FileNotFoundError:
            report.rejected.append("it carries no plait signature (plait-manifest.json is missing)")
            report.untrusted_files = len(present)
            return report
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            report.rejected.append("its plait-manifest.json is damaged")
            report.untrusted_files = len(present)
            return report
        if not hmac.compare_digest(_mac(key, files), mac):
            report.rejected.append(
                f"its signature does not match this user's key ({key_path()}): it was written by another user "
                f"or machine, or changed since"
            )
            report.untrusted_files = len(present)
            return report
        listed = set()
        for rel, entry in files.items():
            if not _is_safe_relative(rel) or not isinstance(entry, dict):
                report.rejected.append(f"{rel!r}: not a path inside the cache")
                continue
            listed.add(rel)
            if rel not in present:
                continue  # a partial copy of the store: what is missing is compiled again
            try:
                data = storage.read_bytes(self.root / rel)
            except OSError:
                continue
            if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                report.rejected.append(f"{rel}: changed since plait signed it")
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            report.loaded += 1
        report.untrusted_files = sum(1 for rel in present if rel not in listed)
        return report

    def _stored(self) -> set[str]:
        """The store's files (paths relative to it, '/'-separated) but its manifest, temporary files and links."""
        if isinstance(self.root, RemotePath):
            base = storage.remote_key(self.root).rstrip("/") + "/"
            names = [k.removeprefix(base) for k in self.root.fs.find(storage.remote_key(self.root))]
            return {n for n in names if n != MANIFEST and not _skipped(n.rsplit("/", 1)[-1])}
        return {p.relative_to(self.root).as_posix() for p in self._files(self.root)}

    # ------------------------------------------------------------------------------------------ writing

    def publish(self, src: Path) -> int:
        """Copy every file of `src` into the store and sign the whole; returns the number of files signed.
        Store files this process did not produce stay unsigned (never loaded) and are not touched."""
        key, why = user_key()
        if key is None:
            warnings.warn(f"compile cache not saved to {self.root}: {why}", stacklevel=2)
            return 0
        remote = self.root if isinstance(self.root, RemotePath) else None
        held = self._signed_files(key) if remote is not None else {}  # on S3: what the signed manifest says it holds
        if remote is None:
            cast(Path, self.root).mkdir(parents=True, exist_ok=True)
        files: dict[str, dict] = {}
        for path in self._files(src):
            rel = path.relative_to(src).as_posix()
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            files[rel] = {"sha256": digest, "size": len(data)}
            if remote is not None:
                if held.get(rel, {}).get("sha256") != digest:
                    storage.retry(functools.partial(storage.write_bytes, remote / rel, data), "compile cache")
            elif not _holds(cast(Path, self.root) / rel, digest):
                _atomic_write(cast(Path, self.root) / rel, data)
        manifest = json.dumps({"version": 1, "files": files, "mac": _mac(key, files)}).encode()
        if remote is not None:  # one PUT, last: readers see the old signed set or the new one
            storage.retry(functools.partial(storage.write_bytes, remote / MANIFEST, manifest), "compile cache")
        else:
            _atomic_write(cast(Path, self.root) / MANIFEST, manifest)
        return len(files)

    def _signed_files(self, key: bytes) -> dict:
        """The files the store's manifest lists, where its signature is this key's ({} otherwise)."""
        try:
            manifest = json.loads(storage.read_bytes(self.root / MANIFEST))
            files = manifest["files"]
            return files if hmac.compare_digest(_mac(key, files), manifest["mac"]) else {}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    @staticmethod
    def _files(root: Path) -> list[Path]:
        if not root.is_dir():
            return []
        out = []
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                if name == MANIFEST and Path(dirpath) == root:
                    continue
                if _skipped(name) or p.is_symlink() or not p.is_file():
                    continue
                out.append(p)
        return sorted(out)


def _skipped(name: str) -> bool:
    return name.startswith(".") or name.endswith(_SKIP_SUFFIXES)


def _holds(target: Path, digest: str) -> bool:
    try:
        if not target.is_file() or target.is_symlink():
            return False
        return hashlib.sha256(target.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def _atomic_write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():  # never write through a link planted in the store
        target.unlink()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def private_dir(prefix: str) -> Path:
    """A fresh directory only this user can enter, removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))  # mode 0700
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
