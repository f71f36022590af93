"""`triollm serve MODEL --data-parallel-size 2`, as a user runs it: two engine-core processes
behind one server. 100 staggered requests all finish with all their tokens and the engine ends
idle; killing one rank's process gives /health 503, a non-zero exit and no orphans."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from server import assert_dies_with_its_engine, run_server, staggered_completion, wait_idle


def test_two_ranks_serve_staggered_requests_and_a_dead_rank_ends_the_server(tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    tokens = [rng.randint(1, 16) for _ in range(100)]
    delays = [rng.random() * 0.5 for _ in range(100)]
    with run_server(tiny_model_dir, "--served-model-name", "m", "--multiprocess", "--data-parallel-size", "2") as srv:
        ranks = srv.engine_children
        assert len(ranks) == 2, ranks
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(staggered_completion, [srv.url] * 100, range(100), tokens, delays))
        assert got == tokens
        wait_idle(srv.url)  # nothing left running or waiting on either rank

        ranks[1].kill()
        assert_dies_with_its_engine(srv, ranks)
