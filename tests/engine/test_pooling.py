"""The pooling runner's engine side: pooling math, PoolingParams, the runner and pooler config
read from a checkpoint, the BERT encoder against transformers, and `EngineCore` on a pooling
model (tiny random BERTs; all-MiniLM-L6-v2 only where its config is the point)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from tinymodel import make_tiny_bert

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.cores import Core, build_engine_core
from triollm.engine.execution.models.bert import load_bert
from triollm.engine.execution.pooler import finish_embedding, pool
from triollm.engine.frontend import POOLING_PLACEHOLDER
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.pooling_core import PoolingEngineCore
from triollm.engine.pooling_outputs import pack_pooled, unpack_pooled
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.request import EngineCoreRequest

# ---------------------------------------------------------------------------------- the math

HIDDEN = torch.tensor(
    [
        [[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]],  # 3 real tokens
        [[2.0, 2.0], [4.0, 0.0], [99.0, 99.0]],  # 2 real tokens, then padding
    ]
)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_mean_pools_real_tokens_only() -> None:
    assert torch.equal(pool(HIDDEN, MASK, "MEAN"), torch.tensor([[3.0, 2.0], [3.0, 1.0]]))


def test_cls_and_last() -> None:
    assert torch.equal(pool(HIDDEN, MASK, "CLS"), torch.tensor([[1.0, 0.0], [2.0, 2.0]]))
    assert torch.equal(pool(HIDDEN, MASK, "LAST"), torch.tensor([[5.0, 4.0], [4.0, 0.0]]))


def test_normalize_and_matryoshka() -> None:
    v = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_embedding(v, None, True), v / 13)
    assert torch.equal(finish_embedding(v, None, False), v)
    assert torch.allclose(finish_embedding(v, 2, True), torch.tensor([0.6, 0.8]))  # cut, then normalised
    rows = finish_embedding(torch.tensor([[3.0, 4.0], [0.0, 2.0]]), None, True)
    assert torch.allclose(rows, torch.tensor([[0.6, 0.8], [0.0, 1.0]]))


def test_pooled_bytes_round_trip() -> None:
    data = torch.randn(3, 5)
    assert torch.equal(unpack_pooled(pack_pooled(data), 3), data)
    assert torch.equal(unpack_pooled(pack_pooled(data[0])), data[0])


def test_pooling_params_checks_and_wire() -> None:
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"dimensions": 0}, {"task": "rerank"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PoolingParams(**bad)  # type: ignore[arg-type]
    p = PoolingParams(truncate_prompt_tokens=-1, dimensions=8, normalize=False, task="embed")
    req = EngineCoreRequest("r", [1, 2], POOLING_PLACEHOLDER, pooling_params=p)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back.pooling_params == p
    old = EngineCoreRequest("r", [1, 2], POOLING_PLACEHOLDER)  # generative: the field is omitted
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=EngineCoreRequest).pooling_params is None


# ---------------------------------------------------------------------------------- config


@pytest.fixture(scope="module")
def tiny_berts(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-bert")
    return {
        "cls": make_tiny_bert(root / "cls", minilm_dir, pooling="cls_token", normalize=False),
        "last": make_tiny_bert(root / "last", minilm_dir, pooling="lasttoken"),
        "mean": make_tiny_bert(root / "mean", minilm_dir, matryoshka=True, hidden_act="gelu_new"),
    }


def test_runner_follows_the_architecture(minilm_dir: Path, tiny_model_dir: Path) -> None:
    mc = ModelConfig.from_pretrained(minilm_dir)
    assert mc.runner_type == "pooling" and mc.pooler is not None
    assert (mc.pooler.pooling_type, mc.pooler.normalize, mc.max_model_len) == ("MEAN", True, 256)
    assert not mc.pooler.is_matryoshka
    assert ModelConfig.from_pretrained(tiny_model_dir).runner_type == "generate"
    with pytest.raises(ValueError, match=r"runner: 'generate' is not supported for BertModel"):
        ModelConfig.from_pretrained(minilm_dir, runner="generate")
    decoder = ModelConfig.from_pretrained(tiny_model_dir, runner="pooling")  # a decoder embedder
    assert decoder.runner_type == "pooling" and decoder.pooler is not None
    assert (decoder.pooler.pooling_type, decoder.pooler.normalize) == ("LAST", True)
    with pytest.raises(ValueError, match="max_model_len: 600 exceeds the model's max_position_embeddings"):
        ModelConfig.from_pretrained(minilm_dir, max_model_len=600)
    assert (
        EngineArgs(model=str(minilm_dir), runner="pooling", max_model_len=512)
        .create_engine_config()
        .model.max_model_len
        == 512
    )
    with pytest.raises(ValueError, match="runner"):
        EngineArgs(runner="draft")


def test_pooler_config_from_sentence_transformers_files(tiny_berts: dict[str, Path]) -> None:
    cls, last, mean = (ModelConfig.from_pretrained(tiny_berts[k]).pooler for k in ("cls", "last", "mean"))
    assert cls is not None and last is not None and mean is not None
    assert (cls.pooling_type, cls.normalize) == ("CLS", False)
    assert (last.pooling_type, last.normalize) == ("LAST", True)
    assert (mean.pooling_type, mean.is_matryoshka, mean.matryoshka_dimensions) == ("MEAN", True, (8, 16, 32))


def test_bert_matches_transformers(tiny_berts: dict[str, Path]) -> None:
    from transformers import BertModel as HFBert

    for key in ("cls", "mean"):  # exact GELU and the tanh one
        path = tiny_berts[key]
        ours = load_bert(ModelConfig.from_pretrained(path))
        ref = HFBert.from_pretrained(path).eval()
        lengths = [7, 3, 12]
        ids = torch.randint(1000, 5000, (sum(lengths),), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            hidden, mask = ours(ids, lengths)
            start = 0
            for i, n in enumerate(lengths):
                expected = ref(ids[start : start + n].unsqueeze(0)).last_hidden_state[0]
                torch.testing.assert_close(hidden[i, :n], expected, atol=2e-5, rtol=1e-4)
                assert mask[i].sum() == n
                start += n


# ---------------------------------------------------------------------------------- the core


def test_engine_core_on_a_pooling_model(tiny_berts: dict[str, Path]) -> None:
    config = EngineArgs(model=str(tiny_berts["last"]), max_num_batched_tokens=64, max_num_seqs=8).create_engine_config()
    core = build_engine_core(config)
    assert isinstance(core, PoolingEngineCore) and isinstance(core, Core) and core.num_blocks == 0
    params = PoolingParams(task="embed")
    prompts = {"a": [101, 2000, 102], "b": list(range(1000, 1040)), "c": [101, 7592, 2088, 999, 102], "gone": [5, 6]}
    for rid, ids in prompts.items():
        core.add_request(EngineCoreRequest(rid, ids, POOLING_PLACEHOLDER, pooling_params=params))
    with pytest.raises(ValueError, match="already running"):
        core.add_request(EngineCoreRequest("a", [1], POOLING_PLACEHOLDER, pooling_params=params))
    with pytest.raises(ValueError, match="pooling_params"):
        core.add_request(EngineCoreRequest("x", [1], POOLING_PLACEHOLDER))
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(EngineCoreRequest("x", [1] * 65, POOLING_PLACEHOLDER, pooling_params=params))
    core.abort_requests("gone")
    core.check_integrity()
    assert core.statistics().num_waiting == 3
    # The oldest ("a", 3 tokens) is joined by the nearest in length ("c", 5) while the padded
    # batch (requests x longest prompt) fits 64 tokens: "b" (40) would make it 3 x 40, so it
    # waits for the next step, although it came before "c".
    steps = [core.step() for _ in range(2)]
    assert [[o.request_id for o in step] for step in steps] == [["a", "c"], ["b"]]
    assert not core.has_unfinished_requests() and core.step() == []
    core.add_request(EngineCoreRequest("d", [7] * 20, POOLING_PLACEHOLDER, pooling_params=params))
    core.add_request(EngineCoreRequest("e", [8] * 30, POOLING_PLACEHOLDER, pooling_params=params))
    assert [o.request_id for o in core.step()] == ["d", "e"]  # 2 x 30 fits: one batch
    # A long oldest request takes the long ones; the short ones go together next, whatever
    # their order of arrival.
    for rid, n in (("long", 30), ("s1", 4), ("l1", 28), ("s2", 3), ("s3", 5)):
        core.add_request(EngineCoreRequest(rid, [9] * n, POOLING_PLACEHOLDER, pooling_params=params))
    assert [o.request_id for o in core.step()] == ["long", "l1"]
    assert [o.request_id for o in core.step()] == ["s1", "s2", "s3"]  # equally near: the older first
    core.check_integrity()
    for out in [o for step in steps for o in step]:
        assert out.finished and out.new_token_ids == []
        assert out.pooled is not None
        vec = unpack_pooled(out.pooled)
        assert vec.shape == (32,) and torch.isclose(vec.norm(), torch.tensor(1.0))


def test_each_core_refuses_the_other_kind_of_model(tiny_berts: dict[str, Path], tiny_model_dir: Path) -> None:
    pooling = EngineArgs(model=str(tiny_berts["last"])).create_engine_config()
    with pytest.raises(ValueError, match=r"runner: EngineCore .*'pooling'.*build_engine_core\(config\)"):
        EngineCore(pooling)
    generate = EngineArgs(model=str(tiny_model_dir), kv_cache_memory_bytes=1 << 20).create_engine_config()
    with pytest.raises(ValueError, match=r"runner: PoolingEngineCore .*'generate'.*build_engine_core"):
        PoolingEngineCore(generate)
    core = build_engine_core(generate)
    assert isinstance(core, EngineCore) and isinstance(core, Core)
    core.close()
