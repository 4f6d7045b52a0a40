"""What recording the 70B base's identity costs (``trainbench.families.decoder.hf_checkpoint.identity``, taken at every
run's start and every resume), against hashing the whole base.

Builds, in a temporary folder, Llama-2-70B's checkpoint as MLPerf ships it (80 blocks, fused qkv_proj, bf16, 15
shards) with every header real and the tensor data left as holes (sparse files: 138 GB that take no disk), times
``identity`` over it, then times sha256 and blake2b over a real file of ``--hash-gib`` GiB to give the bytes per
second a full hash would read at, and what that means for 138 GB. Removes its files when done.

    python perf/base_identity.py --out OUT/base_identity.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.families.decoder.hf_checkpoint import INDEX, identity  # noqa: E402

HIDDEN, LAYERS, MLP, VOCAB, KV = 8192, 80, 28672, 32000, 1024


def tensors() -> list[tuple[str, list[int]]]:
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.qkv_proj.weight", [HIDDEN + 2 * KV, HIDDEN]), (p + "self_attn.o_proj.weight",
                [HIDDEN, HIDDEN]), (p + "mlp.gate_proj.weight", [MLP, HIDDEN]), (p + "mlp.up_proj.weight",
                [MLP, HIDDEN]), (p + "mlp.down_proj.weight", [HIDDEN, MLP]), (p + "input_layernorm.weight", [HIDDEN]),
                (p + "post_attention_layernorm.weight", [HIDDEN])]  # fmt: skip
    return out + [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]


def write_sparse_checkpoint(folder: Path, shards: int = 15) -> int:
    items = tensors()
    per = -(-len(items) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape in items[s * per : (s + 1) * per]:
            n = 2
            for d in shape:
                n *= d
            header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            weight_map[key] = name
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # the data: a hole
        total += 8 + len(raw) + offset
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def hash_rate(path: Path, algorithm: str) -> float:
    h = hashlib.new(algorithm)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return path.stat().st_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hash-gib", type=float, default=2.0, help="size of the real file hashed (GiB)")
    parser.add_argument("--reps", type=int, default=5, help="timings of identity() (the first reads cold pages)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tb-base-identity-"))
    try:
        total = write_sparse_checkpoint(root)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            identity(root)
            times.append(time.perf_counter() - start)
        real = root / "real.bin"
        with open(real, "wb") as f:
            block = os.urandom(16 * 2**20)
            for _ in range(int(args.hash_gib * 64)):
                f.write(block)
        rates = {a: hash_rate(real, a) for a in ("sha256", "blake2b")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "checkpoint_bytes": total, "shards": 15,
        "identity_s": [round(t, 4) for t in times],
        "full_hash_gb_per_s": {a: round(r / 1e9, 2) for a, r in rates.items()},
        "full_hash_s_for_the_checkpoint": {a: round(total / r, 1) for a, r in rates.items()},
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
