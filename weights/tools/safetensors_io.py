"""safetensors files read and written with the Python standard library only (no torch, no numpy), and the
FNV-1a checksums of the stored tensors that lesson 01 checks its loader against. Used by convert_dtype.py
(which must run on a machine without PyTorch) and make_reference.py.

The format: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the tensors' bytes, contiguous, offsets relative to the end of the header.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import subprocess
import tempfile
from pathlib import Path

DTYPE_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1}


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the file offset where tensor data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def read_tensors(path: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict]:
    """{name: (dtype, shape, raw bytes)} in file order, and the file's __metadata__ ({} when absent)."""
    header, base = read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    with open(path, "rb") as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            out[name] = (info["dtype"], info["shape"], f.read(end - begin))
    return out, meta


def write_tensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict | None) -> None:
    """Writes tensors contiguously in name order; the header is padded with spaces to a multiple of 8 bytes
    (as the reference implementation does) so that every tensor starts 8-byte aligned."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    names = sorted(tensors)
    for name in names:
        dtype, shape, data = tensors[name]
        n = 1
        for d in shape:
            n *= d
        if len(data) != n * DTYPE_SIZE[dtype]:
            raise ValueError(f"{name}: {len(data)} bytes for {dtype} {shape}")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(tensors[name][2])


def safetensors_files(model_dir: Path) -> list[Path]:
    """The model's weight files: the shards named by model.safetensors.index.json, else model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise SystemExit(f"error: {model_dir} has neither model.safetensors nor model.safetensors.index.json")
    return [single]


# ---------------------------------------------------------------------------------------------------------
# Weight checksums: FNV-1a 64 of each tensor's raw bytes as stored (lesson 01 checks its loader with them).

FNV_OFFSET, FNV_PRIME, MASK64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
_FNV_C = r"""
#include <stdint.h>
#include <stddef.h>
uint64_t fnv1a64(const unsigned char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) { h ^= p[i]; h *= 0x100000001b3ULL; }
  return h;
}
"""


def _compiled_fnv():
    """FNV-1a is a serial byte loop: Python does ~10 MB/s, C ~1 GB/s. Compile a 5-line helper with the
    system C compiler when there is one (a 1B model has 2.5 GB of weights); else return None."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix="tvllm_fnv_"))
        (tmp / "fnv.c").write_text(_FNV_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp / "fnv.so"), str(tmp / "fnv.c")],
                       check=True, capture_output=True)
        lib = ctypes.CDLL(str(tmp / "fnv.so"))
        lib.fnv1a64.restype = ctypes.c_uint64
        lib.fnv1a64.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return lib.fnv1a64
    except (OSError, subprocess.CalledProcessError):
        return None


def fnv1a64_py(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK64
    return h


def weight_checksums(model_dir: Path) -> dict:
    """{name: {file, dtype, shape, nbytes, fnv1a64}} for every tensor of the model, names sorted per file."""
    fast = _compiled_fnv()
    table = {}
    for path in safetensors_files(model_dir):
        # ACCESS_COPY: a private writable mapping (the file is never written), so that ctypes can take the
        # address of the bytes without copying them.
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            (n,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8:8 + n])
            base = 8 + n
            for name in sorted(k for k in header if k != "__metadata__"):
                info = header[name]
                begin, end = (base + o for o in info["data_offsets"])
                if fast is not None and end > begin:
                    view = ctypes.c_char.from_buffer(mm, begin)  # no copy
                    h = fast(ctypes.addressof(view), end - begin)
                    del view  # the mmap cannot close while a view of it exists
                else:
                    h = fnv1a64_py(mm[begin:end])
                table[name] = {"file": path.name, "dtype": info["dtype"], "shape": info["shape"],
                               "nbytes": end - begin, "fnv1a64": f"{h:016x}"}
    return table
