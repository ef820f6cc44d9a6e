"""A real Kubernetes control plane and node on one machine, for the tests, ``make cluster`` and the
operator's scale benchmark: processes, ports, waiting, certificates, the control plane (``kube``,
``kwok``) and a real node (``node``, ``relay``)."""
