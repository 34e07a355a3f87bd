"""A GPU site's task whose result takes longer to come back than one poll of the
no-workers watch (a replay's mark-outs over a slow link between sites) is still
returned: the watch waits for the task to finish, then gathers its result once.
Before, `future.result(timeout=poll)` started the gather again at every poll and cut
it at the poll's end: bench/placement.py's replay (tens of MB of mark-outs over its
100 Mbit/s link, 0.5 s polls) waited for ever."""

from __future__ import annotations

import threading

import pytest

from quantloop.blocks.site import Site
from quantloop.tasks.engine import driver
from quantloop.tasks.runtime.sites import StageSite

RESULT_BYTES = 64 * 2**20  # gathered through the scheduler: far longer than the poll


def big_result(n: int) -> bytes:
    return bytes(range(256)) * (n // 256)


@pytest.mark.slow
def test_a_result_longer_to_gather_than_a_poll_comes_back(monkeypatch):
    from distributed import Client, LocalCluster

    # 1 ms polls: no gather of 64 MB between two processes fits in one.
    monkeypatch.setattr(driver, "NO_WORKERS_POLL_S", 0.001)
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                           resources={"GPU": 1}, dashboard_address=None)  # fmt: skip
    with cluster, Client(cluster) as client:
        site = Site(name="B", scheduler_address=cluster.scheduler_address, gpus=1)
        got: dict = {}

        def run() -> None:
            try:
                got["value"] = StageSite(site, client).run(big_result, RESULT_BYTES)
            except Exception as exc:  # the test's thread: shown by the assertion below
                got["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the result never came back: gathered again at each poll"
        assert "error" not in got, got.get("error")
        assert got["value"] == big_result(RESULT_BYTES)
