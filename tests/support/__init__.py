"""Helpers behind the tests' fixtures that only the tests need: `wan.py` shapes the link between two
regions, and the GPT-2 example's job and the tracking files' readers. The control plane, the real
node and the S3 server (SeaweedFS, ``diloco_testbed.s3_server``: the ``s3`` fixture of
`tests/conftest.py`) are ``diloco_testbed`` (`testbed/`), shared with `make cluster` and the
benchmarks.
"""
