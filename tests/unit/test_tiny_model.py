"""The tiny Kimi-shaped checkpoint: shape, declarations, shards, tokenizer, determinism."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.support import tiny_model
from tests.support.hub_server import HubServer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.generate(tmp_path_factory.mktemp("tiny") / "m")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def safetensors_header(path: Path) -> dict:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def test_config_is_deepseek_v3_mla_sized_for_cpu(model: Path) -> None:
    config = read_json(model / "config.json")
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # What the CPU MLA backend accepts (FIELD-NOTES §4).
    assert config["kv_lora_rank"] == 512
    assert config["qk_rope_head_dim"] == 64
    assert config["topk_method"] == "noaux_tc"
    assert config["scoring_func"] == "sigmoid"
    assert config["torch_dtype"] == "bfloat16"
    assert config["first_k_dense_replace"] < config["num_hidden_layers"]  # has a MoE layer


def test_config_declares_fp8_kv_cache_like_kimi(model: Path) -> None:
    quant = read_json(model / "config.json")["quantization_config"]
    assert quant["quant_method"] == "modelopt"
    assert quant["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    # Weights stay bf16: every module is excluded from weight quantization.
    assert quant["ignore"] == ["*"]


def test_sidecar_declares_fp8_kv_cache_like_kimi(model: Path) -> None:
    sidecar = read_json(model / "hf_quant_config.json")
    assert sidecar["producer"]["name"] == "modelopt"
    assert sidecar["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert sidecar["quantization"]["exclude_modules"] == ["*"]


def test_shards_and_index_agree(model: Path) -> None:
    index = read_json(model / "model.safetensors.index.json")
    shards = sorted(model.glob("model-*-of-*.safetensors"))
    assert [p.name for p in shards] == [f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    listed: dict[str, str] = {}
    total = 0
    for shard in shards:
        header = safetensors_header(shard)
        header.pop("__metadata__")
        for name, entry in header.items():
            listed[name] = shard.name
            total += entry["data_offsets"][1] - entry["data_offsets"][0]
    assert listed == index["weight_map"]
    assert total == index["metadata"]["total_size"]


def test_every_weight_has_its_shape(model: Path) -> None:
    config = read_json(model / "config.json")
    expected = dict(tiny_model.tensor_shapes(config))
    found = {}
    for shard in model.glob("model-*.safetensors"):
        header = safetensors_header(shard)
        header.pop("__metadata__")
        found.update({name: entry["shape"] for name, entry in header.items()})
    assert found == expected
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in found
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in found


def test_tokenizer_round_trips_and_has_chat_tokens(model: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "Hello world, 42 servers!"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    config = read_json(model / "config.json")
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    assert tokenizer.token_to_id("<|im_end|>") == config["eos_token_id"]
    tok_config = read_json(model / "tokenizer_config.json")
    assert "<|im_assistant|>" in tok_config["chat_template"]
    generation = read_json(model / "generation_config.json")
    assert config["eos_token_id"] in generation["eos_token_id"]


def test_generation_is_deterministic(model: Path, tmp_path: Path) -> None:
    again = tiny_model.generate(tmp_path / "again")
    for path in sorted(model.iterdir()):
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_generate_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        tiny_model.generate(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_cache_is_keyed_by_recipe_and_reused(tmp_path: Path) -> None:
    first = tiny_model.cached(tmp_path)
    assert first.name == f"tiny-kimi-{tiny_model.recipe_hash()}"
    stamp = (first / "config.json").stat().st_mtime_ns
    assert tiny_model.cached(tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert tiny_model.recipe_hash(seed=1) != tiny_model.recipe_hash()


def test_published_model_downloads_from_the_hub(model: Path, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    sha = tiny_model.publish(model, tmp_path / "hub")
    assert tiny_model.publish(model, tmp_path / "hub") == sha  # same files, same commit
    with HubServer(tmp_path / "hub") as hub:
        out = snapshot_download(
            tiny_model.REPO, endpoint=hub.endpoint, local_dir=tmp_path / "dl", token=False
        )
    for path in model.iterdir():
        assert (Path(out) / path.name).read_bytes() == path.read_bytes(), path.name
