#!/usr/bin/env python3
"""What vLLM's own code says about its MLA attention backends, read from a released wheel.

For one vLLM version: the CUDA platform's backend priority list
(``vllm/platforms/cuda.py``, ``_get_backend_priorities``), each MLA backend's
``supported_kv_cache_dtypes`` and ``supports_compute_capability`` (inherited
ones included), and whether ``--kv-cache-dtype auto`` resolves to a modelopt
checkpoint's KV declaration (``vllm/utils/torch_utils.py``,
``get_kv_cache_quant_algo_string``). The x86_64 wheel is read by HTTP range
requests (its central directory and a few members, not the 0.2-0.5 GB file);
the members are cached under ``$VLLM_FLEET_CACHE/vllm-src/<version>/``, keyed
by the wheel's file name.

The code is parsed, never imported: list literals are read with
``ast.literal_eval`` and the two small predicates are compiled alone, with
stand-ins for the enum and the device capability.

    python tools/vllm_source.py 0.34.0 --cc 9.0 --kv fp8
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import sys
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # imported as tools.vllm_source (tests) or run as a script from tools/
    from tools.check_pins import PYPI_SIMPLE, fetch_listing
except ModuleNotFoundError:
    from check_pins import PYPI_SIMPLE, fetch_listing

WANTED = (
    "vllm/platforms/cuda.py",
    "vllm/v1/attention/backends/mla/*.py",
    "vllm/v1/attention/backends/registry.py",
    "vllm/attention/backends/registry.py",
    "vllm/v1/attention/backend.py",
    "vllm/attention/backends/abstract.py",
    "vllm/model_executor/layers/attention/mla_attention.py",
    "vllm/utils/torch_utils.py",
    "vllm/model_executor/models/registry.py",
)
# Kimi-K2.5 / DeepSeek-V3 MLA: 64 query heads per rank at TP 8 is 8; head size 576.
MLA_HEAD_SIZE = 576
BLOCK = 1 << 20


def cache_root() -> Path:
    base = os.environ.get("VLLM_FLEET_CACHE") or Path.home() / ".cache" / "vllm-fleet"
    return Path(base) / "vllm-src"


class RangeFile:
    """A read-only, seekable view of a remote file through HTTP Range requests (1 MiB blocks)."""

    def __init__(self, url: str, timeout: float = 120) -> None:
        self.url, self.timeout, self.pos = url, timeout, 0
        self.blocks: dict[int, bytes] = {}
        request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
        if not total.isdigit():
            raise OSError(f"{url}: the server does not answer Range requests")
        self.size = int(total)

    def _block(self, index: int) -> bytes:
        if index not in self.blocks:
            start = index * BLOCK
            end = min(self.size, start + BLOCK) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                self.blocks[index] = resp.read()
        return self.blocks[index]

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            block = self._block(self.pos // BLOCK)
            offset = self.pos % BLOCK
            piece = block[offset : offset + end - self.pos]
            out += piece
            self.pos += len(piece)
        return bytes(out)


def wheel_url(version: str, index: str = PYPI_SIMPLE) -> tuple[str, str]:
    """(file name, URL) of the version's x86_64 manylinux wheel on the index."""
    for item in fetch_listing(index, "vllm"):
        name = item.filename
        if name.startswith(f"vllm-{version}-") and name.endswith("x86_64.whl") and item.url:
            return name, urllib.parse.urljoin(f"{index.rstrip('/')}/vllm/", item.url)
    raise LookupError(f"no x86_64 wheel of vllm {version} on {index}")


def fetch(version: str, index: str = PYPI_SIMPLE) -> Path:
    """The cached members of the version's wheel; read from the index the first time."""
    dest = cache_root() / version
    manifest = dest / "MANIFEST.json"
    if manifest.is_file():
        return dest
    name, url = wheel_url(version, index)
    members: list[str] = []
    with zipfile.ZipFile(RangeFile(url)) as wheel:  # type: ignore[arg-type]
        for info in wheel.infolist():
            if any(fnmatch.fnmatch(info.filename, pattern) for pattern in WANTED):
                target = dest / info.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(info))
                members.append(info.filename)
    # Written last: a run cut short leaves no manifest, and the next one reads again.
    manifest.write_text(json.dumps({"wheel": name, "members": sorted(members)}, indent=1))
    return dest


# ------------------------------------------------------------------------- reading the code


@dataclass(frozen=True)
class DeviceCapability:
    """Stand-in for vllm.platforms.interface.DeviceCapability (the fields the predicates read)."""

    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class _EnumNames:
    """AttentionBackendEnum.X -> "X": the priority function then returns plain names."""

    def __getattr__(self, name: str) -> str:
        return name


@dataclass
class Source:
    version: str
    root: Path
    trees: dict[str, ast.Module] = field(default_factory=dict)

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self.trees:
            path = self.root / rel
            if not path.is_file():
                return None
            self.trees[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        return self.trees[rel]

    def first(self, *rels: str) -> tuple[str, ast.Module]:
        for rel in rels:
            tree = self.tree(rel)
            if tree is not None:
                return rel, tree
        raise LookupError(f"vllm {self.version}: none of {', '.join(rels)} in the wheel")


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _compile(func: ast.FunctionDef, namespace: dict[str, Any]) -> Any:
    """The function alone: no decorators, annotations or imports (their names are stand-ins)."""
    func = ast.parse(ast.unparse(func)).body[0]  # a copy
    assert isinstance(func, ast.FunctionDef)
    func.decorator_list = []
    func.returns = None
    for arg in [*func.args.args, *func.args.kwonlyargs]:
        arg.annotation = None
    func.body = [n for n in func.body if not isinstance(n, ast.Import | ast.ImportFrom)] or [
        ast.Pass()
    ]
    module = ast.Module(body=[func], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "<vllm source>", "exec"), namespace)
    return namespace[func.name]


def is_quantized_kv_cache(kv_cache_dtype: str | None) -> bool:
    # vllm/v1/attention/backend.py: kv_cache_dtype.startswith("fp8") (0.16 to 0.34).
    return bool(kv_cache_dtype) and str(kv_cache_dtype).startswith("fp8")


def priorities(src: Source, cc: DeviceCapability, kv_cache_dtype: str) -> list[str]:
    """_get_backend_priorities(use_mla=True, ...) as this version's cuda.py computes it."""
    _, tree = src.first("vllm/platforms/cuda.py")
    func = _function(tree, "_get_backend_priorities")
    if func is None:
        raise LookupError(f"vllm {src.version}: no _get_backend_priorities in cuda.py")
    namespace = {
        "AttentionBackendEnum": _EnumNames(),
        "is_quantized_kv_cache": is_quantized_kv_cache,
    }
    fn = _compile(func, namespace)
    wanted = {
        "use_mla": True,
        "device_capability": cc,
        "kv_cache_dtype": kv_cache_dtype,
        "num_heads": 8,
        "head_size": MLA_HEAD_SIZE,
        "use_non_causal": False,
        "use_mm_prefix": False,
        "use_sparse": False,
    }
    names = {a.arg for a in [*func.args.args, *func.args.kwonlyargs]}
    return list(fn(**{k: v for k, v in wanted.items() if k in names}))


def backend_paths(src: Source) -> dict[str, str]:
    """Enum member -> "module.Class", from the AttentionBackendEnum class body."""
    rel, tree = src.first(
        "vllm/v1/attention/backends/registry.py", "vllm/attention/backends/registry.py"
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in ("AttentionBackendEnum", "_Backend"):
            paths = {}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    value = stmt.value
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        paths[stmt.targets[0].id] = value.value
            return paths
    raise LookupError(f"vllm {src.version}: no AttentionBackendEnum in {rel}")


@dataclass(frozen=True)
class Member:
    """A class attribute or method found on a class or one of its bases."""

    node: ast.AST
    where: str  # "file.py:Class"


def _class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    rel = module.replace(".", "/") + ".py"
    tree = src.tree(rel)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return rel, node
    return None


def _base_module(src: Source, rel: str, name: str) -> str:
    """The module a base class name comes from: an import in rel, else rel itself."""
    tree = src.tree(rel)
    for node in tree.body if tree else []:
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            return node.module or ""
    return rel[:-3].replace("/", ".")


def lookup(src: Source, path: str, attr: str) -> Member | None:
    """attr on the class at path ("module.Class"), walking its bases as Python would (MRO-ish)."""
    module, _, name = path.rpartition(".")
    found = _class(src, module, name)
    if found is None:
        return None
    rel, cls = found
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == attr:
            return Member(stmt, f"{rel}:{name}")
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            target = stmt.targets[0]
        if isinstance(target, ast.Name) and target.id == attr:
            return Member(stmt, f"{rel}:{name}")
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name is None:
            continue
        hit = lookup(src, f"{_base_module(src, rel, base_name)}.{base_name}", attr)
        if hit is not None:
            return hit
    return None


def kv_dtypes(src: Source, path: str) -> tuple[list[str] | None, str]:
    """supported_kv_cache_dtypes (None: not declared anywhere, every dtype passes)."""
    hit = lookup(src, path, "supported_kv_cache_dtypes")
    if hit is None:
        return None, "no supported_kv_cache_dtypes"
    assert isinstance(hit.node, ast.Assign | ast.AnnAssign) and hit.node.value is not None
    return list(ast.literal_eval(hit.node.value)), hit.where


def supports_cc(src: Source, path: str, cc: DeviceCapability) -> tuple[bool, str]:
    hit = lookup(src, path, "supports_compute_capability")
    if hit is None:
        return True, "no supports_compute_capability"
    assert isinstance(hit.node, ast.FunctionDef)
    fn = _compile(hit.node, {"DeviceCapability": DeviceCapability})
    return bool(fn(None, cc)), hit.where


def kv_cache_dtype_for(src: Source, declared: str) -> str:
    """The engine's --kv-cache-dtype for `auto` and a modelopt checkpoint declaring `declared`."""
    if declared == "none":
        return "auto"
    tree = src.tree("vllm/utils/torch_utils.py")
    if tree is None or _function(tree, "get_kv_cache_quant_algo_string") is None:
        return "auto"  # this version never reads the checkpoint's KV declaration
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP"
        ):
            return str(ast.literal_eval(node.value).get(declared, "auto"))
    return "auto"


def reads_kv_declaration(src: Source) -> bool:
    return kv_cache_dtype_for(src, "fp8") != "auto"


def select(src: Source, cc: DeviceCapability, declared_kv: str) -> dict[str, Any]:
    """The MLA backends this version accepts, in its priority order, and why others fail."""
    dtype = kv_cache_dtype_for(src, declared_kv)
    paths = backend_paths(src)
    accepted: list[str] = []
    rejected: dict[str, str] = {}
    for name in priorities(src, cc, dtype):
        if "SPARSE" in name:
            continue  # DeepSeek-V3.2's sparse MLA; Kimi-K2.5's attention is dense
        path = paths.get(name)
        if not path:
            rejected[name] = "not in AttentionBackendEnum"
            continue
        ok_cc, cc_where = supports_cc(src, path, cc)
        dtypes, kv_where = kv_dtypes(src, path)
        if not ok_cc:
            rejected[name] = (
                f"supports_compute_capability({cc.as_version_str()}) is False [{cc_where}]"
            )
        elif dtypes and dtype not in dtypes:
            rejected[name] = f"kv {dtype} not in {dtypes} [{kv_where}]"
        else:
            accepted.append(name)
    return {
        "version": src.version,
        "kv_cache_dtype": dtype,
        "accepted": accepted,
        "rejected": rejected,
    }


def load(version: str) -> Source:
    return Source(version, fetch(version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="+")
    parser.add_argument("--cc", action="append", help="compute capability, e.g. 9.0")
    parser.add_argument("--kv", action="append", choices=["none", "fp8"])
    args = parser.parse_args(argv)
    for version in args.version:
        src = load(version)
        print(f"vllm {version}: reads a modelopt KV declaration: {reads_kv_declaration(src)}")
        for text in args.cc or ["8.0", "8.9", "9.0", "10.0", "11.0", "12.0"]:
            major, minor = (int(p) for p in text.split("."))
            for kv in args.kv or ["none", "fp8"]:
                got = select(src, DeviceCapability(major, minor), kv)
                print(f"  SM{text} KV {kv} ({got['kv_cache_dtype']}): {got['accepted']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
