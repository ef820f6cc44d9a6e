"""The local runner: `diloco run` starts a synchronizer and N learners on this machine, injects chaos,
shows progress and writes a report."""
