"""What a job's spec refers to that must exist in the cluster before its children are created:
Secrets and ConfigMaps (with the keys it reads), ServiceAccounts and PriorityClasses its pods name.
The operator checks each (``runtime.reconcile.check_spec``) and says which is missing."""

from __future__ import annotations

from diloco_operator.schema.spec import DiLoCoJobSpec, sync_pod_settings, unit_pod_settings


def secret_references(spec: DiLoCoJobSpec) -> list[tuple[str, str]]:
    """(secret name, key) pairs the spec refers to; each must exist before children are created."""
    refs: list[tuple[str, str]] = []
    creds = spec.storage.credentials_secret_ref
    if creds is not None:
        refs += [(creds.name, creds.access_key_id_key), (creds.name, creds.secret_access_key_key)]
    external = spec.synchronizer.external
    if external is not None:
        refs.append((external.token_secret_ref.name, external.token_secret_ref.key))
    tls = spec.synchronizer.tls
    if tls is not None:
        refs += [(tls.secret_name, "tls.crt"), (tls.secret_name, "tls.key")]
    ca = spec.synchronizer.ca
    if ca is not None and ca.secret_name is not None:
        refs.append((ca.secret_name, ca.key))
    return refs


def config_map_references(spec: DiLoCoJobSpec) -> list[tuple[str, str]]:
    """(ConfigMap name, key) pairs the spec refers to; each must exist before children are created."""
    ca = spec.synchronizer.ca
    return [(ca.config_map_name, ca.key)] if ca is not None and ca.config_map_name is not None else []


def pod_settings_references(spec: DiLoCoJobSpec) -> tuple[list[str], list[str]]:
    """The ServiceAccounts and the PriorityClasses the job's pods name (each must exist: the
    apiserver refuses a pod that names a missing one, and its StatefulSet or Deployment stays empty)."""
    every = [spec.pods, *(unit_pod_settings(spec, u) for u in spec.learner_units)]
    if spec.synchronizer.external is None:
        every.append(sync_pod_settings(spec))
    accounts = sorted({s.service_account_name for s in every if s.service_account_name})
    classes = sorted({s.priority_class_name for s in every if s.priority_class_name})
    return accounts, classes
