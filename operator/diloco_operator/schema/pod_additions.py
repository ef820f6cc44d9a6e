"""What a job adds to its learner pods: environment variables, volumes and volume mounts.

``spec.learners.env`` / ``volumes`` / ``volumeMounts`` go into every learner pod, a unit's own
(``spec.learnerUnits[].env`` ...) after them, and both after the operator's own entries. They are
Kubernetes objects taken as written (an EnvVar's ``valueFrom``, any volume source); the checks here
refuse what would override the operator's contract with the learner (``diloco_operator.builders.env``) or
collide with its volumes, and what the apiserver would refuse in the StatefulSet anyway (a volume
declared twice, a mount of a volume the pod does not have), with the field to change. The CRD
refuses the reserved names at admission too (CEL rules; a test checks they name these lists).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Every DILOCO_ variable is the worker's configuration, which the spec sets: a user's would
# silently override (or be overridden by) a setting of the spec.
RESERVED_ENV_PREFIX = "DILOCO_"
# The unit's torch.distributed group (the rank is the ordinal of HOSTNAME), and the job's storage.
RESERVED_ENV: tuple[str, ...] = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTNAME",
    "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
)  # fmt: skip
# The operator's own volumes of a learner pod (``diloco_operator.builders``).
OWN_VOLUMES: tuple[str, ...] = ("config", "tmp", "sync-ca", "learner-token")

Objects = Sequence[Mapping[str, Any]]


def reserved_env(name: str) -> bool:
    return name.startswith(RESERVED_ENV_PREFIX) or name in RESERVED_ENV


def _name(obj: Mapping[str, Any]) -> str:
    name = obj.get("name") if isinstance(obj, Mapping) else None
    return name if isinstance(name, str) else ""


def env_problems(env: Objects) -> list[str]:
    out = []
    for i, var in enumerate(env):
        name = _name(var)
        if not name:
            out.append(f"item {i} needs a name")
        elif name.startswith(RESERVED_ENV_PREFIX):
            out.append(
                f"{name} (item {i}) is not allowed: every DILOCO_ variable is the learner's configuration, "
                "which the operator sets from the spec (spec.train, spec.model, spec.data, spec.diloco)"
            )
        elif name in RESERVED_ENV:
            out.append(
                f"{name} (item {i}) is not allowed: the operator sets it (or the learner derives its rank "
                f"from it); reserved: {', '.join(RESERVED_ENV)}"
            )
    return out


def volume_problems(volumes: Objects) -> list[str]:
    out = []
    for i, volume in enumerate(volumes):
        name = _name(volume)
        if not name:
            out.append(f"item {i} needs a name")
        elif name in OWN_VOLUMES:
            out.append(
                f"'{name}' (item {i}) is one of the operator's own volumes ({', '.join(OWN_VOLUMES)}); "
                "choose another name"
            )
        if isinstance(volume, Mapping):
            out += [
                f"'{name}' (item {i}): {key} must be an object (a volume source), not {_kind(source)}"
                for key, source in volume.items()
                if key != "name" and not isinstance(source, Mapping)
            ]
    return out


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def mount_problems(mounts: Objects) -> list[str]:
    return [
        f"item {i} needs a name and a mountPath"
        for i, mount in enumerate(mounts)
        if not _name(mount) or not isinstance(mount.get("mountPath"), str) or not mount["mountPath"]
    ]


def _checked(
    problems: Callable[[Objects], list[str]],
) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    def check(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        found = problems(objects)
        if found:
            raise ValueError("; ".join(found))
        return objects

    return check


# field validators of the spec's models: the names the CRD's CEL rules refuse at admission
check_env = _checked(env_problems)
check_volumes = _checked(volume_problems)
check_mounts = _checked(mount_problems)


def unit_problems(where: str, volumes: Objects, mounts: Objects) -> list[str]:
    """One unit's volumes and mounts together with the job's (``spec.learners`` first): each volume
    declared once, each mount of a declared volume (what no schema can check: ``validate_job``)."""
    names = [_name(v) for v in volumes]
    twice = sorted({n for n in names if n and names.count(n) > 1})
    out = [
        f"{where}: volume '{n}' is declared more than once (spec.learners.volumes and the unit's "
        "volumes together)"
        for n in twice
    ]
    unknown = sorted({_name(m) for m in mounts if _name(m) and _name(m) not in names})
    out += [
        f"{where}: volumeMounts name '{n}', which neither spec.learners.volumes nor the unit's "
        "volumes declare"
        for n in unknown
    ]
    return out
