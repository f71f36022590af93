"""The real `triollm serve` on all-MiniLM-L6-v2 (the pooling runner picked from the
architecture), driven with the official `openai` client: embeddings equal `LLM.embed`'s, in float
and base64; `/score` is their cosine; the generate endpoints answer 400."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from server import run_server

from triollm import LLM

TEXTS = ["A man is eating food.", "A man is riding a horse on a sunny beach near the sea."]


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> list[list[float]]:
    with LLM(str(minilm_dir), num_threads=1) as llm:
        return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]


def test_embeddings_and_scores_over_http(minilm_dir: Path, reference: list[list[float]]) -> None:
    with run_server(minilm_dir, "--served-model-name", "minilm") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        for kwargs in ({"encoding_format": "float"}, {}):  # without one, the client asks base64 and decodes it
            out = client.embeddings.create(model="minilm", input=TEXTS, **kwargs)  # type: ignore[arg-type]
            got = torch.tensor([d.embedding for d in out.data])
            assert got.shape == (2, 384) and out.usage.prompt_tokens > 0
            assert torch.allclose(got, torch.tensor(reference), atol=1e-5)
        raw = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="base64")
        decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")  # type: ignore[arg-type]
        assert np.allclose(decoded, reference[0], atol=1e-5)
        r = httpx.post(f"{srv.url}/score", json={"model": "minilm", "text_1": TEXTS[0], "text_2": TEXTS})
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        expected = [
            float(torch.nn.functional.cosine_similarity(torch.tensor(reference[0]), torch.tensor(e), dim=0))
            for e in reference
        ]
        assert scores == pytest.approx(expected, abs=1e-5)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="minilm", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model="minilm", input=TEXTS, encoding_format="hex")  # type: ignore[arg-type]
        assert err.value.body["param"] == "encoding_format"  # type: ignore[index]
