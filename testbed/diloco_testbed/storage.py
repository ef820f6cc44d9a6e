"""S3-compatible storage on a cluster, for the tests and ``make cluster``: SeaweedFS (``weed mini``)
as a Deployment and a Service ``seaweedfs`` in namespace ``storage``, with one identity; and in a
namespace of jobs, the Secret ``diloco-s3`` holding that identity's keys, and the bucket ``diloco``.
That is the storage examples/single-region.yaml names (``http://seaweedfs.storage.svc:8333``).

``build_*`` return the objects as data; ``deploy_seaweedfs``, ``create_secret_and_bucket`` and
``set_up_storage`` create them.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from .pods import pod_logs, wait_pod_phase
from .waiting import wait_for

STORAGE_NAMESPACE = "storage"
SERVICE = "seaweedfs"
S3_PORT = 8333
ENDPOINT = f"http://{SERVICE}.{STORAGE_NAMESPACE}.svc:{S3_PORT}"
BUCKET = "diloco"
SECRET = "diloco-s3"
IDENTITIES = "seaweedfs-identities"
BUCKET_POD = "make-bucket"
LABELS = {"app": SERVICE}
KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

# Runs in the synchronizer's image (it has boto3) with the Secret's keys: SeaweedFS may still be
# starting, so it retries; a bucket already there (another namespace made it) is fine.
BUCKET_SCRIPT = """\
import boto3, botocore.exceptions as e, time
s3 = boto3.client('s3', endpoint_url='{endpoint}', region_name='us-east-1')
for attempt in range(60):
    try:
        s3.create_bucket(Bucket='{bucket}'); break
    except e.ClientError as exc:
        if 'BucketAlreadyOwnedByYou' in str(exc) or 'BucketAlreadyExists' in str(exc): break
        time.sleep(2)
    except e.BotoCoreError:
        time.sleep(2)
print(s3.head_bucket(Bucket='{bucket}')['ResponseMetadata']['HTTPStatusCode'])
"""


@dataclass(frozen=True)
class S3Credentials:
    access_key: str
    secret_key: str


def new_s3_credentials() -> S3Credentials:
    return S3Credentials("AK" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))


def storage_namespaces(values: Iterable[str]) -> list[str]:
    """The namespaces named by ``--storage`` options, each one comma-separated list: in order,
    once each. A name Kubernetes would refuse is a ValueError."""
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    bad = [name for name in names if not NAMESPACE_NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"not namespace names (lowercase letters, digits and '-'): {', '.join(bad)}")
    return list(dict.fromkeys(names))


def build_identities_secret(creds: S3Credentials) -> dict[str, Any]:
    """SeaweedFS's S3 configuration: one identity, ``admin``, with these keys."""
    identity = {
        "name": "admin",
        "credentials": [{"accessKey": creds.access_key, "secretKey": creds.secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    return {
        "metadata": {"name": IDENTITIES},
        "stringData": {"identities.json": json.dumps({"identities": [identity]})},
    }


def build_seaweedfs_deployment(image: str) -> dict[str, Any]:
    """One ``weed mini`` pod (master, volume, filer and S3 in one process) on emptyDir volumes."""
    args = [
        "mini",
        "-dir=/data",
        "-ip=$(POD_IP)",
        "-ip.bind=0.0.0.0",
        f"-s3.port={S3_PORT}",
        "-s3.config=/etc/seaweedfs/identities.json",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    mounts = [
        {"name": "data", "mountPath": "/data"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "identities", "mountPath": "/etc/seaweedfs", "readOnly": True},
    ]
    container = {
        "name": SERVICE,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "s3", "containerPort": S3_PORT}],
        "readinessProbe": {"tcpSocket": {"port": S3_PORT}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
        "volumeMounts": mounts,
    }
    volumes = [
        {"name": "data", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "identities", "secret": {"secretName": IDENTITIES}},
    ]
    pod_spec = {
        "containers": [container],
        "securityContext": {"runAsUser": 65535, "fsGroup": 65535},
        "volumes": volumes,
    }
    return {
        "metadata": {"name": SERVICE, "labels": LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": LABELS},
            "template": {"metadata": {"labels": LABELS}, "spec": pod_spec},
        },
    }


def build_seaweedfs_service() -> dict[str, Any]:
    return {
        "metadata": {"name": SERVICE},
        "spec": {"selector": LABELS, "ports": [{"name": "s3", "port": S3_PORT, "targetPort": "s3"}]},
    }


def build_storage_secret(creds: S3Credentials) -> dict[str, Any]:
    """The Secret ``diloco-s3`` a job's ``storage.credentialsSecretRef`` names."""
    keys = dict(zip(KEYS, (creds.access_key, creds.secret_key), strict=True))
    return {"metadata": {"name": SECRET}, "stringData": keys}


def build_bucket_pod(image: str) -> dict[str, Any]:
    """A pod that makes the bucket with the keys of the Secret ``diloco-s3`` and prints 200."""
    env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": k}}} for k in KEYS]
    container = {
        "name": BUCKET_POD,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", BUCKET_SCRIPT.format(endpoint=ENDPOINT, bucket=BUCKET)],
        "env": env,
    }
    return {"metadata": {"name": BUCKET_POD}, "spec": {"restartPolicy": "Never", "containers": [container]}}


def deploy_seaweedfs(api: k8s.ApiClient, image: str, *, timeout: float = 180) -> S3Credentials:
    """SeaweedFS in namespace ``storage`` (which must exist), ready; returns its identity's keys."""
    creds = new_s3_credentials()
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    core.create_namespaced_secret(STORAGE_NAMESPACE, build_identities_secret(creds))
    apps.create_namespaced_deployment(STORAGE_NAMESPACE, build_seaweedfs_deployment(image))
    core.create_namespaced_service(STORAGE_NAMESPACE, build_seaweedfs_service())

    def ready() -> bool:
        deployment = apps.read_namespaced_deployment(name=SERVICE, namespace=STORAGE_NAMESPACE)
        return (deployment.status.ready_replicas or 0) >= 1

    wait_for(ready, timeout=timeout, what="SeaweedFS ready", interval=1)
    return creds


def create_secret_and_bucket(api: k8s.ApiClient, ns: str, creds: S3Credentials, image: str) -> None:
    """The Secret ``diloco-s3`` in ``ns``, and the bucket, made by a pod of ``image`` (the
    synchronizer's) with the Secret's keys: proof that a job's pods reach the storage with them."""
    core = k8s.CoreV1Api(api)
    core.create_namespaced_secret(ns, build_storage_secret(creds))
    core.create_namespaced_pod(ns, build_bucket_pod(image))
    pod = wait_pod_phase(core, ns, BUCKET_POD, ("Succeeded", "Failed"), timeout=240)
    logs = pod_logs(core, ns, BUCKET_POD)
    if pod.status.phase != "Succeeded" or "200" not in logs:
        raise RuntimeError(f"the bucket {BUCKET} could not be made from namespace {ns}:\n{logs}")
    core.delete_namespaced_pod(BUCKET_POD, ns)


def create_namespace(api: k8s.ApiClient, name: str) -> None:
    """Namespace ``name``, unless it exists."""
    try:
        k8s.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def set_up_storage(api: k8s.ApiClient, images: dict[str, str], namespaces: list[str]) -> S3Credentials:
    """SeaweedFS in namespace ``storage``, and the Secret and bucket for jobs in each of
    ``namespaces`` (made if missing). ``images`` names the ``seaweedfs`` and ``sync`` images."""
    create_namespace(api, STORAGE_NAMESPACE)
    creds = deploy_seaweedfs(api, images["seaweedfs"])
    for ns in namespaces:
        create_namespace(api, ns)
        create_secret_and_bucket(api, ns, creds, images["sync"])
    return creds
