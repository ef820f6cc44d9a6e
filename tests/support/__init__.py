"""Helpers behind the shared test fixtures: real servers started as plain processes.

`kube.py` runs a Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok) or attaches to an existing cluster; `s3.py` runs SeaweedFS as an S3 server. Both are
exposed as pytest fixtures by `tests/conftest.py`.
"""
