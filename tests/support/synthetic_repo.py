"""Build a hub repo shaped like nvidia/Kimi-K2.5-NVFP4 for tests/support/hub_server.py.

119 ``model-000NN-of-00119.safetensors`` shards (valid safetensors headers, size chosen
by the caller), ``model.safetensors.index.json``, ``config.json``, ``hf_quant_config.json``,
tokenizer files and custom code (``*.py``), as in the real repo (140 files there).

    python -m tests.support.synthetic_repo --root DIR [--shard-bytes N] [--shards 119]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

from tests.support.hub_server import FileMeta, commit_files
from tests.support.kimi_checkpoint import write_kimi_configs

KIMI_REPO = "nvidia/Kimi-K2.5-NVFP4"
SHARDS = 119
_BLOCK = 1 << 20


def shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _tensor_names(index: int) -> list[str]:
    return [
        f"language_model.model.layers.{index}.mlp.experts.0.down_proj.weight",
        f"language_model.model.layers.{index}.mlp.experts.0.down_proj.weight_scale",
    ]


def write_shard(path: Path, index: int, data_bytes: int) -> list[str]:
    """A valid safetensors file: u64 header length, JSON header, then raw tensor bytes."""
    names = _tensor_names(index)
    half = data_bytes // 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header[names[0]] = {"dtype": "U8", "shape": [half], "data_offsets": [0, half]}
    header[names[1]] = {
        "dtype": "U8",
        "shape": [data_bytes - half],
        "data_offsets": [half, data_bytes],
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    # Distinct per shard, cheap to make: a seeded block repeated (compression plays no role).
    block = hashlib.shake_256(f"shard-{index}".encode()).digest(min(_BLOCK, max(data_bytes, 1)))
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        left = data_bytes
        while left > 0:
            piece = block[: min(len(block), left)]
            fh.write(piece)
            left -= len(piece)
    return names


def build_repo(
    root: Path,
    repo_id: str = KIMI_REPO,
    shard_bytes: int = 4096,
    shards: int = SHARDS,
    tags: tuple[str, ...] = ("v1.0",),
) -> str:
    """Write the repo under ``root`` (hub_server layout); return its commit sha.

    Also writes ``<sha>.meta.json`` (sizes, git sha1, sha256) so the server need not hash.
    """
    repo_dir = root / repo_id
    staging = repo_dir / "commits" / "staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for index in range(1, shards + 1):
        name = shard_name(index, shards)
        for tensor in write_shard(staging / name, index, shard_bytes):
            weight_map[tensor] = name
    index_doc = {"metadata": {"total_size": shard_bytes * shards}, "weight_map": weight_map}
    write_kimi_configs(staging)  # config.json + hf_quant_config.json, Kimi-K2.5-NVFP4 shaped
    texts: dict[str, Any] = {
        "model.safetensors.index.json": index_doc,
        "generation_config.json": {"max_length": 262144},
        "tokenizer_config.json": {"tokenizer_class": "TikTokenTokenizer", "auto_map": {}},
        "special_tokens_map.json": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
    }
    for name, doc in texts.items():
        (staging / name).write_text(json.dumps(doc, indent=2) + "\n")
    (staging / "tiktoken.model").write_bytes(hashlib.shake_256(b"bpe").digest(2048))
    for name in (
        "configuration_kimi_k25.py",
        "modeling_kimi_k25.py",
        "tokenization_kimi.py",
        "chat_template.jinja",
    ):
        (staging / name).write_text(f"# synthetic {name} for {repo_id}\n")
    (staging / "README.md").write_text(f"# {repo_id} (synthetic test copy)\n")
    (staging / "docs").mkdir()
    (staging / "docs" / "deploy_guidance.md").write_text("Serve with vLLM.\n")

    return commit_files(repo_dir, staging, tags, move=True)


def update_repo(
    root: Path,
    repo_id: str,
    changes: dict[str, bytes],
    drop: tuple[str, ...] = (),
    tags: tuple[str, ...] = (),
) -> str:
    """A new ``main`` commit: the current one with ``changes`` written and ``drop`` removed.

    Tests use same-size changes, so nothing but a digest can tell the commits apart.
    """
    repo_dir = root / repo_id
    current = json.loads((repo_dir / "refs.json").read_text())["main"]
    staging = repo_dir / "commits" / "staging"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(repo_dir / "commits" / current, staging)
    for name, data in changes.items():
        (staging / name).write_bytes(data)
    for name in drop:
        (staging / name).unlink()
    return commit_files(repo_dir, staging, tags, move=True)


def add_hostile_listing(root: Path, repo_id: str, ref: str, names: list[str]) -> str:
    """A commit whose listing also names ``names`` (hostile paths, never served as files).

    Its files are the ``main`` commit's (a symlink to that directory); only the listing
    (``<sha>.meta.json``) carries the extra names, as a compromised mirror's would.
    """
    repo_dir = root / repo_id
    refs = json.loads((repo_dir / "refs.json").read_text())
    base = refs["main"]
    meta = json.loads((repo_dir / "commits" / f"{base}.meta.json").read_text())
    for name in names:
        meta[name] = FileMeta(size=7, oid=hashlib.sha1(name.encode()).hexdigest(), sha256=None)
        meta[name] = meta[name].__dict__
    sha = hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    link = repo_dir / "commits" / sha
    if not link.exists():
        link.symlink_to(repo_dir / "commits" / base)
    (repo_dir / "commits" / f"{sha}.meta.json").write_text(json.dumps(meta))
    refs[ref] = sha
    (repo_dir / "refs.json").write_text(json.dumps(refs, indent=2) + "\n")
    return sha


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a Kimi-shaped synthetic hub repo.")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--repo-id", default=KIMI_REPO)
    parser.add_argument("--shard-bytes", type=int, default=4096)
    parser.add_argument("--shards", type=int, default=SHARDS)
    args = parser.parse_args(argv)
    print(build_repo(args.root, args.repo_id, args.shard_bytes, args.shards))


if __name__ == "__main__":
    main()
