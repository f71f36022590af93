"""A local Ray cluster on the loopback interface only, for the Ray backend's tests.

`_node_ip_address="127.0.0.1"`, no dashboard, no usage statistics, and
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, without which Ray replaces 127.0.0.1 by the machine's
network address (`ray._private.services.resolve_ip_for_localhost`). The variables are set before
Ray is imported (it reads them then) and stay set while the cluster runs, so that servers started
as subprocesses, which join it through `RAY_ADDRESS`, keep to the loopback interface too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 as the node's address
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report to the network
}


@contextmanager
def local_ray(num_cpus: int = 4) -> Iterator[Any]:
    """Ray, initialised on a new local loopback cluster (skips the test where Ray is missing)."""
    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    try:
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'triollm[ray]')")
        from ray._private import ray_constants

        assert not ray_constants.ENABLE_RAY_CLUSTER, "Ray was imported before the loopback settings"
        ray.init(
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            object_store_memory=80 * 1024 * 1024,
            log_to_driver=False,
        )
        try:
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            yield ray
        finally:
            ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
