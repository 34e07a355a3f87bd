"""Prefect flows: research and its stages."""

from quantloop.tasks.runtime import heartbeats

# Every flow run in a process that runs quantloop's flows ends without waiting on its
# heartbeat thread (tasks/runtime/heartbeats.py): in `quantloop run`, in a worker's
# `quantloop engine`, in a test.
heartbeats.install()
