#!/usr/bin/env python3
"""tests/checkpoint/interop.py — the Python side of gmoe's safetensors interop test.

Driven by tests/checkpoint/test_interop.cpp; uses the reference implementation (PyPI `safetensors`)
and numpy:

  interop.py probe          exit 0 when safetensors and numpy import (prints their versions)
  interop.py write DIR SEED write files with Python's safetensors into DIR, and DIR/py_expected.json
                            (every tensor's dtype, shape and bytes in hex) for gmoe to compare
  interop.py check DIR      load DIR/gmoe_*.safetensors (written by gmoe) with Python's safetensors
                            and compare with DIR/gmoe_expected.json; exit 1 on any difference

numpy has no bfloat16 or float8, so those tensors go through safetensors' raw API (serialize_file
with a dtype name and a buffer of uint8/uint16 bits; deserialize returns raw bytes): bytes are
compared exactly, which is what "identical tensors" means for any dtype.
"""
import json
import os
import sys

# safetensors code -> (numpy dtype or None, name for safetensors' raw API, element size)
DTYPES = {
    "F32": ("float32", "float32", 4),
    "F16": ("float16", "float16", 2),
    "I32": ("int32", "int32", 4),
    "I64": ("int64", "int64", 8),
    "BF16": (None, "bfloat16", 2),
    "F8_E4M3": (None, "float8_e4m3fn", 1),
    "F8_E5M2": (None, "float8_e5m2", 1),
    "F8_E8M0": (None, "float8_e8m0fnu", 1),
}
# Names some safetensors versions return from deserialize, mapped back to codes.
NAME_TO_CODE = {v[1]: k for k, v in DTYPES.items()}


def code_of(dtype):
    return NAME_TO_CODE.get(dtype, dtype)


def serialize_raw(tensors, path, metadata):
    """tensors: {name: (code, shape, bytes)} written with safetensors' raw serializer."""
    import numpy as np
    import safetensors

    keep = []
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8: pointer-based specs
        specs = {}
        for name, (code, shape, data) in tensors.items():
            buf = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, np.uint8)
            keep.append(buf)
            specs[name] = safetensors.TensorSpec(dtype=DTYPES[code][1], shape=list(shape),
                                                 data_ptr=buf.ctypes.data, data_len=len(data))
        safetensors.serialize_file(specs, path, metadata=metadata)
    else:  # older versions take dicts with the bytes
        specs = {name: {"dtype": DTYPES[code][1], "shape": list(shape), "data": data}
                 for name, (code, shape, data) in tensors.items()}
        safetensors.serialize_file(specs, path, metadata=metadata)


def write(out_dir, seed):
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    expected = {}

    def rand_bytes(n):
        return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()

    # numpy dtypes through the numpy API (what most Python users call).
    arrays = {
        "f32.matrix": rng.standard_normal((3, 4)).astype(np.float32),
        "f32.scalar": np.array(rng.standard_normal(), dtype=np.float32),
        "f32.empty": np.zeros((0, 3), dtype=np.float32),
        "f16.vector": rng.standard_normal(5).astype(np.float16),
        "i32.cube": rng.integers(-2**31, 2**31 - 1, size=(2, 2, 2), dtype=np.int32),
        "i64.vector": rng.integers(-2**62, 2**62, size=7, dtype=np.int64),
        # Stacked expert weights [E, out, in] as a framework would store them.
        "layers.0.experts.fc2.weight": rng.standard_normal((4, 3, 5)).astype(np.float32),
    }
    meta = {"format": "np", "seed": str(seed)}
    save_file(arrays, os.path.join(out_dir, "py_numpy.safetensors"), metadata=meta)
    code = {np.dtype("float32"): "F32", np.dtype("float16"): "F16",
            np.dtype("int32"): "I32", np.dtype("int64"): "I64"}
    expected["py_numpy.safetensors"] = {
        "metadata": meta,
        "tensors": {k: {"dtype": code[v.dtype], "shape": list(v.shape), "hex": v.tobytes().hex()}
                    for k, v in arrays.items()}}

    # bf16 / fp8 through the raw API, with per-expert bf16 weights among them.
    raw = {
        "bf16.matrix": ("BF16", (6, 5), rand_bytes(60)),
        "e4m3.matrix": ("F8_E4M3", (4, 8), rand_bytes(32)),
        "e5m2.vector": ("F8_E5M2", (9,), rand_bytes(9)),
        "e8m0.vector": ("F8_E8M0", (3,), rand_bytes(3)),
        "bf16.empty": ("BF16", (2, 0), b""),
    }
    for e in range(3):
        raw["layers.0.experts.fc1.weight%d" % e] = ("BF16", (4, 2), rand_bytes(16))
    meta2 = {"format": "raw"}
    serialize_raw(raw, os.path.join(out_dir, "py_raw.safetensors"), meta2)
    expected["py_raw.safetensors"] = {
        "metadata": meta2,
        "tensors": {k: {"dtype": c, "shape": list(s), "hex": d.hex()} for k, (c, s, d) in raw.items()}}

    with open(os.path.join(out_dir, "py_expected.json"), "w") as f:
        json.dump(expected, f)


def check(in_dir):
    import numpy as np
    import safetensors
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with open(os.path.join(in_dir, "gmoe_expected.json")) as f:
        expected = json.load(f)
    failures = []
    checked = 0
    for file_name, want in expected.items():
        path = os.path.join(in_dir, file_name)
        # The raw reader runs the reference implementation's full validation (offsets contiguous,
        # sizes consistent) and hands back bytes for every dtype.
        with open(path, "rb") as f:
            got = {name: info for name, info in safetensors.deserialize(f.read())}
        if set(got) != set(want["tensors"]):
            failures.append("%s: keys %s != %s" % (file_name, sorted(got), sorted(want["tensors"])))
        with safe_open(path, framework="numpy") as f:
            if (f.metadata() or {}) != want["metadata"]:
                failures.append("%s: metadata %r != %r" % (file_name, f.metadata(), want["metadata"]))
        numpy_only = all(DTYPES[t["dtype"]][0] is not None for t in want["tensors"].values())
        arrays = load_file(path) if numpy_only else {}
        for name, t in want["tensors"].items():
            checked += 1
            g = got.get(name)
            if g is None:
                continue
            data = bytes(g["data"])
            if code_of(g["dtype"]) != t["dtype"] or list(g["shape"]) != t["shape"]:
                failures.append("%s:%s: %s%s != %s%s" % (file_name, name, g["dtype"], g["shape"],
                                                         t["dtype"], t["shape"]))
            if data != bytes.fromhex(t["hex"]):
                failures.append("%s:%s: bytes differ" % (file_name, name))
            if numpy_only:
                a = arrays[name]
                ref = np.frombuffer(bytes.fromhex(t["hex"]), dtype=DTYPES[t["dtype"]][0]).reshape(t["shape"])
                if a.dtype != ref.dtype or a.shape != ref.shape or a.tobytes() != ref.tobytes():
                    failures.append("%s:%s: numpy array differs" % (file_name, name))
    for msg in failures:
        print("interop check FAILED:", msg, file=sys.stderr)
    print("interop check: %d tensors, %d failures" % (checked, len(failures)))
    return 1 if failures else 0


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "probe":
        import numpy
        import safetensors
        print("safetensors", safetensors.__version__, "numpy", numpy.__version__)
        return 0
    if mode == "write" and len(sys.argv) == 4:
        write(sys.argv[2], int(sys.argv[3]))
        return 0
    if mode == "check" and len(sys.argv) == 3:
        return check(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
