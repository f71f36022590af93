"""External load balancing, as vLLM's `--data-parallel-rank`: one `triollm serve` per data
parallel rank, each with its own engine core and its share of the cores, the user's balancer in
front. Two servers (`-dp 2 --data-parallel-rank 0/1`) serve independently: the same greedy
tokens, each its own `engine` label in /metrics, and one dying leaves the other serving."""

from __future__ import annotations

from pathlib import Path

import httpx
from server import assert_dies_with_its_engine, run_server, wait_idle


def _complete(url: str, prompt: str) -> dict[str, object]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def test_two_servers_one_rank_each_serve_independently(tiny_model_dir: Path) -> None:
    common = ("--served-model-name", "m", "--multiprocess", "-dp", "2")
    with run_server(tiny_model_dir, *common, "--data-parallel-rank", "0") as rank0, run_server(
        tiny_model_dir, *common, "-dpn", "1"
    ) as rank1:
        for k, srv in enumerate((rank0, rank1)):
            assert len(srv.engine_children) == 1  # its own rank only
            assert any(f"data parallel rank {k} of 2" in line for line in srv.log), srv.log
        prompts = [f"request {i}" for i in range(6)]
        a = [_complete(rank0.url, p) for p in prompts]
        b = [_complete(rank1.url, p) for p in prompts]
        assert [c["choices"][0]["text"] for c in a] == [c["choices"][0]["text"] for c in b]  # type: ignore[index]
        assert all(c["usage"]["completion_tokens"] == 8 for c in a + b)  # type: ignore[index]
        for k, srv in enumerate((rank0, rank1)):
            wait_idle(srv.url)
            metrics = httpx.get(f"{srv.url}/metrics", timeout=5).text
            assert f'vllm:num_requests_running{{engine="{k}",model_name="m"}}' in metrics, metrics

        engine1 = rank1.engine_children
        engine1[0].kill()
        assert_dies_with_its_engine(rank1, engine1)
        assert httpx.get(f"{rank0.url}/health", timeout=5).status_code == 200
        assert _complete(rank0.url, "still here")["usage"]["completion_tokens"] == 8  # type: ignore[index]
