"""Config files shaped like nvidia/Kimi-K2.5-NVFP4, for tests, the demo and generators.

``write_kimi_configs`` writes ``config.json`` (KimiK25ForConditionalGeneration
wrapping a DeepSeek-V3 text config, ModelOpt ``quantization_config`` with
``config_groups``, a long ``ignore`` list and an FP8 ``kv_cache_scheme``) and
``hf_quant_config.json`` (the ModelOpt sidecar: ``producer``, NVFP4,
``kv_cache_quant_algo`` FP8, group size 16, a long ``exclude_modules`` list).

Other generators (the hub repository, the tiny servable model) call it with
their own text-config sizes; ``write_kimi_checkpoint`` adds a few small shard
files and the shard index for tests that need a whole directory.

Also usable as a script: ``python tests/support/kimi_checkpoint.py DIR``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

# The text model's config as Kimi-K2.5 ships it (DeepSeek-V3 architecture, MLA).
KIMI_TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

VISION_CONFIG: dict[str, Any] = {
    "model_type": "moonvit",
    "hidden_size": 1152,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
}

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.39.0"}
# What the real checkpoint declares, and what hf_quant_config removes.
KV_CACHE_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
KV_CACHE_QUANT_ALGO = "FP8"


def excluded_modules(num_layers: int, prefix: str = "language_model.") -> list[str]:
    """Modules left in higher precision: attention, the dense layer, vision, head."""
    modules = ["lm_head", f"{prefix}lm_head"]
    modules += [f"{prefix}model.layers.{i}.self_attn*" for i in range(num_layers)]
    modules += [f"{prefix}model.layers.0.mlp*", "mm_projector*", "vision_tower*"]
    return modules


def quantization_config(num_layers: int, prefix: str = "language_model.") -> dict[str, Any]:
    """config.json's ``quantization_config`` (compressed-tensors style, ModelOpt)."""
    fp4 = {"dynamic": False, "group_size": 16, "num_bits": 4, "type": "float"}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": dict(fp4),
                "weights": dict(fp4),
                "targets": ["Linear"],
            }
        },
        "ignore": excluded_modules(num_layers, prefix),
        "kv_cache_scheme": dict(KV_CACHE_SCHEME),
        "producer": dict(MODELOPT_PRODUCER),
        "quant_algo": "NVFP4",
        "quant_method": "modelopt",
    }


def hf_quant_config(num_layers: int, *, top_level_kv: bool = False) -> dict[str, Any]:
    """The ModelOpt sidecar; *top_level_kv* puts the KV algo beside ``quantization``."""
    quantization: dict[str, Any] = {"quant_algo": "NVFP4"}
    if not top_level_kv:
        quantization["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO
    quantization["group_size"] = 16
    quantization["exclude_modules"] = excluded_modules(num_layers)
    doc: dict[str, Any] = {"producer": dict(MODELOPT_PRODUCER), "quantization": quantization}
    if top_level_kv:
        doc["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO
    return doc


def kimi_config(
    *,
    wrapper: bool = True,
    nested_quant: bool = False,
    text_config_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json as a dict.

    *wrapper*: KimiK25ForConditionalGeneration with ``text_config`` (True) or a
    flat DeepseekV3ForCausalLM config (False, what a tiny CPU model serves).
    *nested_quant*: also put a ``quantization_config`` under ``text_config``.
    """
    text = copy.deepcopy(KIMI_TEXT_CONFIG)
    text.update(text_config_overrides or {})
    layers = int(text["num_hidden_layers"])
    if not wrapper:
        text["quantization_config"] = quantization_config(layers, prefix="")
        return text
    if nested_quant:
        text["quantization_config"] = quantization_config(layers, prefix="")
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": 163605,
        "model_type": "kimi_k25",
        "pad_token_id": 163839,
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_unified_vision_chunk": True,
        "vision_config": dict(VISION_CONFIG),
        "quantization_config": quantization_config(layers),
    }


def dump(
    doc: Any, indent: int | str | None = 2, ensure_ascii: bool = True, trailing_newline: bool = True
) -> str:
    """JSON text in one of the styles checkpoints use (indent None = compact)."""
    separators = (",", ":") if indent is None else None
    text = json.dumps(doc, indent=indent, ensure_ascii=ensure_ascii, separators=separators)
    return text + ("\n" if trailing_newline else "")


def write_kimi_configs(
    directory: str | Path,
    *,
    indent: int | str | None = 2,
    ensure_ascii: bool = True,
    trailing_newline: bool = True,
    wrapper: bool = True,
    nested_quant: bool = False,
    top_level_kv: bool = False,
    sidecar: bool = True,
    text_config_overrides: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write config.json (and hf_quant_config.json unless *sidecar* is False).

    Returns file name -> path. See :func:`kimi_config` and :func:`hf_quant_config`
    for the shape options; *indent*, *ensure_ascii* and *trailing_newline* set the
    text style (4, "\\t" and None = compact are all seen in the wild).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = kimi_config(
        wrapper=wrapper, nested_quant=nested_quant, text_config_overrides=text_config_overrides
    )
    docs: dict[str, Any] = {"config.json": config}
    if sidecar:
        layers = int((config.get("text_config") or config)["num_hidden_layers"])
        docs["hf_quant_config.json"] = hf_quant_config(layers, top_level_kv=top_level_kv)
    paths = {}
    for name, doc in docs.items():
        path = directory / name
        path.write_text(dump(doc, indent, ensure_ascii, trailing_newline), encoding="utf-8")
        paths[name] = path
    return paths


def write_kimi_checkpoint(
    directory: str | Path, *, shards: int = 3, shard_bytes: int = 4096, **config_options: Any
) -> dict[str, Path]:
    """A whole (unservable) checkpoint directory: configs, shard index, small shards."""
    directory = Path(directory)
    paths = write_kimi_configs(directory, **config_options)
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        (directory / name).write_bytes(bytes((i * 37 + j) % 251 for j in range(shard_bytes)))
        weight_map[f"language_model.model.layers.{i - 1}.mlp.experts.0.weight"] = name
        paths[name] = directory / name
    index = {"metadata": {"total_size": shards * shard_bytes}, "weight_map": weight_map}
    paths["model.safetensors.index.json"] = directory / "model.safetensors.index.json"
    paths["model.safetensors.index.json"].write_text(json.dumps(index, indent=2) + "\n")
    for name, text in (
        ("generation_config.json", json.dumps({"max_length": 262144}, indent=2) + "\n"),
        ("tokenizer_config.json", json.dumps({"model_max_length": 262144}, indent=2) + "\n"),
    ):
        (directory / name).write_text(text)
        paths[name] = directory / name
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--configs-only", action="store_true")
    parser.add_argument("--indent", default="2", help="2, 4, tab or compact")
    args = parser.parse_args()
    indent: int | str | None = {"tab": "\t", "compact": None}.get(args.indent)
    if args.indent not in ("tab", "compact"):
        indent = int(args.indent)
    writer = write_kimi_configs if args.configs_only else write_kimi_checkpoint
    for path in writer(args.directory, indent=indent).values():
        print(path)


if __name__ == "__main__":
    main()
