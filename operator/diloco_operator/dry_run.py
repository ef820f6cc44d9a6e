"""``diloco operator --dry-run -f job.yaml``: the children the operator would apply, without a cluster.

The same pure builders the operator runs (``children.build_children``), on the spec as the file
gives it: the model applies the CRD's defaults, and the checks that need no cluster run
(``parse_spec``, ``validate_job``). The Secret is not printed: its value is generated once, when
the operator creates it; a comment names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import API_VERSION, KIND, JobRef, learner_token_secret_name, secret_name
from diloco_operator.runtime.queue import queue_problem, with_job_queue
from diloco_operator.schema.spec import SpecError, parse_spec, validate_job

PLACEHOLDER_UID = "<uid of the DiLoCoJob>"  # the apiserver gives it when the job is created


def render_children(documents: Iterable[Any]) -> str:
    """YAML of the children of every DiLoCoJob in ``documents``; raises SpecError for a document
    that is not a DiLoCoJob or whose spec can never work."""
    out: list[str] = []
    for i, doc in enumerate(d for d in documents if d is not None):
        if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
            what = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise SpecError(f"document {i + 1} is a {what}, not a {API_VERSION} {KIND}")
        meta = doc.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name:
            raise SpecError(f"document {i + 1}: metadata.name is missing")
        job = JobRef(name, str(meta.get("namespace") or "default"), str(meta.get("uid") or PLACEHOLDER_UID))
        spec = with_job_queue(parse_spec(doc.get("spec") or {}), meta)
        validate_job(job.name, spec)
        problem = queue_problem(spec)
        if problem is not None:
            raise SpecError(problem)
        header = f"# DiLoCoJob {job.namespace}/{job.name}"
        if spec.synchronizer.external is None:
            header += (
                f"; also Secret {secret_name(job.name)} (the job secret, generated when the job is created)"
            )
        tokens = ", ".join(learner_token_secret_name(job.name, unit.name) for unit in spec.learner_units)
        header += f"; also Secrets {tokens} (each unit's learner token, made from the job secret)"
        body = yaml.safe_dump_all(build_children(job, spec), sort_keys=False)
        out.append(f"{header}\n{body}")
    return "---\n".join(out)
