"""Helpers behind the tests' fixtures that only the tests need: `s3.py` runs SeaweedFS as an S3
server (the ``s3`` fixture of `tests/conftest.py`), `wan.py` shapes the link between two regions, and
the GPT-2 example's job and the tracking files' readers. The control plane and the real node are
``diloco_testbed`` (`testbed/`), shared with `make cluster` and the operator benchmark.
"""
