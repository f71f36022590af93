"""`triollm serve MODEL -dp 2 --data-parallel-backend ray`, as a user runs it on a Ray cluster
(here a local one on the loopback interface, joined through `RAY_ADDRESS`): the engine cores
are Ray actors, staggered requests all finish, and a killed actor ends the server (503 or gone,
non-zero exit) and takes the other rank's actor with it."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from local_ray import local_ray
from server import assert_dies_with_its_engine, run_server, staggered_completion, wait_idle


def _engine_actors() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if "EngineCoreActor" in title:
            found.append(p)
    return found


def test_serve_on_ray_and_a_killed_actor_ends_the_server(tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    tokens = [rng.randint(1, 16) for _ in range(40)]
    delays = [rng.random() * 0.3 for _ in range(40)]
    with local_ray() as ray:
        address = ray.get_runtime_context().gcs_address
        args = ("--served-model-name", "m", "--multiprocess", "-dp", "2", "--data-parallel-backend", "ray")
        with run_server(tiny_model_dir, *args, env={"RAY_ADDRESS": address}, timeout=120) as srv:
            actors = _engine_actors()
            assert len(actors) == 2, actors
            assert not srv.engine_children or not {p.pid for p in actors} & {c.pid for c in srv.engine_children}
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(staggered_completion, [srv.url] * 40, range(40), tokens, delays))
            assert got == tokens
            wait_idle(srv.url)

            actors[0].kill()
            assert_dies_with_its_engine(srv, actors)
