"""One Ray for the whole pytest session: a simulated two-node cluster (`ray.cluster_utils.Cluster`).

Node "head" has 4 logical CPUs (so 4-rank gloo gangs fit in one node even on a 2-core machine), node
"worker" has 2 (so SPREAD gangs can land on two nodes). Small object stores, no dashboard, no usage stats,
no workers started ahead of demand, no token file written to ~/.ray. Use the `ray_cluster` fixture; it yields
`raysys.cluster.sweep.cluster_info()`.

The fixture may be registered more than once (a conftest per test directory, or `pytest_plugins`); the
cluster is started by the first user and shut down when the last one finishes.
"""

from __future__ import annotations

import os

import pytest

HEAD_CPUS, WORKER_CPUS = 4, 2
_STATE: dict = {"cluster": None, "users": 0, "owner": False}


def _start() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # someone else's Ray: use it, leave it running
        return
    # No idle workers started ahead of demand: the gangs' actors carry a runtime env those would not match, so they
    # only cost their start and a share of a core while the session lasts.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": HEAD_CPUS, "num_gpus": 0, "object_store_memory": 100 * 2**20, "include_dashboard": False,
        "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False}})
    cluster.add_node(num_cpus=WORKER_CPUS, num_gpus=0, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    _STATE.update(cluster=cluster, owner=True)


def _stop() -> None:
    import ray

    if _STATE["owner"]:
        ray.shutdown()
        _STATE["cluster"].shutdown()
        _STATE.update(cluster=None, owner=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """A running two-node Ray cluster (head: 4 CPUs, worker: 2 CPUs), shared by the whole session."""
    from raysys.cluster.sweep import cluster_info

    if _STATE["users"] == 0:
        _start()
    _STATE["users"] += 1
    try:
        yield cluster_info()
    finally:
        _STATE["users"] -= 1
        if _STATE["users"] == 0:
            _stop()
