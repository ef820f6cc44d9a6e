"""Kubernetes' name syntaxes as regular expressions, written once: pydantic's ``pattern`` (and so
the CRD's) and the operator's own checks use these."""

from __future__ import annotations

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_KEY_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"

# An object's name (a PriorityClass, a ServiceAccount, a Secret): a DNS subdomain
DNS_SUBDOMAIN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$"
# The name part of a label or annotation key (after the optional ``prefix/``)
KEY_NAME = rf"^{_KEY_NAME}$"
# A label or annotation key: [DNS subdomain/]name
LABEL_KEY = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_KEY_NAME}$"
# A label value naming an object (a LocalQueue, a WorkloadPriorityClass)
LABEL_VALUE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
