"""`VLLM_SERVER_DEV_MODE=1 triollm serve MODEL --data-parallel-size 2`, driven over HTTP as an RL
loop drives vLLM: /collective_rpc answers one result per engine-core process, /sleep frees both
ranks (a completion is then a 400 naming the state), /wake_up restores them and the greedy answer
is the one from before; /pause holds a request until /resume."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from server import run_server

BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def test_sleep_wake_up_rpc_and_pause_over_http_on_two_ranks(tiny_model_dir: Path) -> None:
    args = ("--served-model-name", "m", "--multiprocess", "--data-parallel-size", "2")
    with run_server(tiny_model_dir, *args, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        url = srv.url
        before = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).json()["choices"][0]["text"]
        r = httpx.post(f"{url}/collective_rpc", json={"method": "bytes_per_block"}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 2  # one per data-parallel rank

        assert httpx.post(f"{url}/sleep", params={"level": 2}, timeout=30).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 400 and "sleeping" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/wake_up", timeout=30).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        after = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).json()["choices"][0]["text"]
        assert after == before

        assert httpx.post(f"{url}/pause", timeout=30).json() == {"status": "paused"}
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=30)
            time.sleep(0.5)
            assert not held.done()  # held while paused
            assert httpx.post(f"{url}/resume", timeout=30).json() == {"status": "resumed"}
            assert held.result(timeout=30).json()["choices"][0]["text"] == before
