"""A real Kubernetes control plane and node on one machine, for the tests, ``make cluster`` and the
operator's scale benchmark: processes, ports, waiting, certificates, the control plane (``kube``,
``kwok``), a real node (``node``, ``relay``), its pods (``pods``) and S3 storage on it (``storage``)."""
