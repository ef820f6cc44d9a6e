"""A real Kubernetes control plane and node on one machine, for the tests, ``make cluster`` and the
benchmarks: processes, ports, waiting, certificates, the control plane (``kube``, ``kwok``), a real
node (``node``, ``relay``), its pods (``pods``) and S3 storage on it (``storage``), and an S3 server
as a local process (``s3_server``: SeaweedFS)."""
