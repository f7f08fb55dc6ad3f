#!/usr/bin/env python3
"""Copy a model directory with its floating-point weights stored in another dtype: an F32 or F16 checkpoint
from the bundled BF16 one, to check that every lesson loads any Llama checkpoint.

    python3 weights/tools/convert_dtype.py weights/tiny-llama3 /tmp/tiny-llama3-f32 --dtype f32

Every F32/F16/BF16 tensor is converted (round to nearest even); other files are copied, and config.json's
torch_dtype says the new dtype. Shards stay shards. Needs only the Python standard library (numpy, when
installed, makes it fast enough for a 1B model).

References: make_reference.py computes them in fp32 from the stored weights. When every stored value
converts exactly (BF16 -> F32 always does; BF16 -> F16 does unless a value is outside F16's normal range),
the fp32 model is the same, so the source's reference/ is copied and only its weight checksums are
recomputed. Otherwise the script says to run make_reference.py on the new directory.
"""

from __future__ import annotations

import argparse
import array
import json
import shutil
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import safetensors_io as st  # noqa: E402  (the shared module next to this script)

try:
    import numpy as np
except ImportError:  # the slow path below does the same with the standard library
    np = None

FLOAT_DTYPES = ("F32", "F16", "BF16")
TORCH_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

if sys.byteorder != "little":
    raise SystemExit("error: safetensors is little-endian; this script assumes a little-endian host")


def to_f32(dtype: str, data: bytes) -> bytes:
    """Raw little-endian F32 bytes of a tensor stored as dtype (exact: F32 holds every F16 and BF16 value)."""
    if dtype == "F32":
        return data
    if dtype == "BF16":  # bf16 is the top half of an fp32: put two zero bytes below each value
        out = bytearray(len(data) * 2)
        out[2::4], out[3::4] = data[0::2], data[1::2]
        return bytes(out)
    n = len(data) // 2  # F16
    if np is not None:
        return np.frombuffer(data, dtype="<f2").astype("<f4").tobytes()
    return struct.pack(f"<{n}f", *struct.unpack(f"<{n}e", data))


def from_f32(dtype: str, data: bytes, name: str) -> bytes:
    """Rounds F32 bytes to dtype, to nearest even; a finite value that overflows the dtype is an error."""
    if dtype == "F32":
        return data
    if dtype == "F16":
        n = len(data) // 4
        if np is not None:
            x = np.frombuffer(data, dtype="<f4")
            y = x.astype("<f2")
            if (np.isinf(y) & np.isfinite(x)).any():
                raise SystemExit(f"error: {name}: a value exceeds F16's range (65504)")
            return y.tobytes()
        try:
            return struct.pack(f"<{n}e", *struct.unpack(f"<{n}f", data))
        except OverflowError:
            raise SystemExit(f"error: {name}: a value exceeds F16's range (65504)") from None
    # BF16: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits (lesson 02); NaN stays NaN.
    if np is not None:
        u = np.frombuffer(data, dtype="<u4").astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r[nan] = ((u[nan] >> 16) | 0x40).astype("<u2")
        return r.tobytes()
    u = array.array("I", data)
    r = array.array("H", [((x | 0x400000) >> 16) if (x & 0x7FFFFFFF) > 0x7F800000
                          else (x + 0x7FFF + ((x >> 16) & 1)) >> 16 for x in u])
    return r.tobytes()


def convert_file(src: Path, dst: Path, dtype: str) -> tuple[bool, int]:
    """Converts one safetensors file; returns (every value converted exactly, bytes written for tensors)."""
    tensors, meta = st.read_tensors(src)
    exact, total = True, 0
    out = {}
    for name, (old, shape, data) in tensors.items():
        if old in FLOAT_DTYPES and old != dtype:
            new = from_f32(dtype, to_f32(old, data), name)
            exact = exact and from_f32(old, to_f32(dtype, new), name) == data
            out[name] = (dtype, shape, new)
        else:
            out[name] = (old, shape, data)
        total += len(out[name][2])
    st.write_tensors(dst, out, meta or {"format": "pt"})
    return exact, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="model directory (config.json + safetensors)")
    ap.add_argument("dst", type=Path, help="new model directory (created; must not be src)")
    ap.add_argument("--dtype", required=True, choices=["f32", "f16", "bf16"])
    ap.add_argument("--no-reference", action="store_true", help="do not copy src/reference")
    args = ap.parse_args()
    dtype = args.dtype.upper()
    if not (args.src / "config.json").is_file():
        ap.error(f"{args.src}/config.json not found")
    if args.dst.resolve() == args.src.resolve():
        ap.error("dst must differ from src")
    args.dst.mkdir(parents=True, exist_ok=True)

    weight_files = st.safetensors_files(args.src)
    exact, total = True, 0
    for path in weight_files:
        ok, n = convert_file(path, args.dst / path.name, dtype)
        exact, total = exact and ok, total + n
    index = args.src / "model.safetensors.index.json"
    if index.exists():  # same shard names and weight map; only the total size changes
        idx = json.loads(index.read_text())
        idx.setdefault("metadata", {})["total_size"] = total
        (args.dst / index.name).write_text(json.dumps(idx, indent=2) + "\n")
    skip = {p.name for p in weight_files} | {index.name, "config.json", "reference"}
    for p in sorted(args.src.iterdir()):
        if p.name not in skip and p.is_file():
            shutil.copy2(p, args.dst / p.name)
    config = json.loads((args.src / "config.json").read_text())
    config["torch_dtype"] = TORCH_NAMES[dtype]
    if "dtype" in config:  # the key transformers 5 writes
        config["dtype"] = TORCH_NAMES[dtype]
    (args.dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.dst}: {len(weight_files)} file(s), {total / 1e6:.1f} MB, floating-point tensors as "
          f"{dtype} ({'every value exact' if exact else 'some values rounded'})")

    manifest = args.src / "reference" / "manifest.json"
    if args.no_reference or not manifest.exists():
        return 0
    if not exact:
        shutil.rmtree(args.dst / "reference", ignore_errors=True)
        print(f"references: values were rounded, so make new ones: "
              f"python3 weights/tools/make_reference.py {args.dst}")
        return 0
    ref = args.dst / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    shutil.copytree(args.src / "reference", ref)
    m = json.loads(manifest.read_text())
    m["weights"] = st.weight_checksums(args.dst)
    m["converted_from"] = {"model": str(args.src), "by": "weights/tools/convert_dtype.py", "dtype": dtype,
                           "note": "every stored value converted exactly: the fp32 reference is unchanged"}
    (ref / "manifest.json").write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"references: copied from {args.src / 'reference'} (the fp32 model is the same); checksums remade")
    return 0


if __name__ == "__main__":
    sys.exit(main())
