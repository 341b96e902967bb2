#!/usr/bin/env python3
"""Writes the seed input of the checkpoint fuzzer (tests/fuzz/checkpoint_fuzz.cc): a
small, valid checkpoint (config.json with its manifest, model and optimizer
safetensors) packed as [flags][config len][model len][config][model][optimizer].
    python3 tests/fuzz/make_checkpoint_seed.py OUT_FILE"""
import json, struct, sys, zlib


def safetensors(tensors, metadata):
    header, data = {}, b""
    for name, values in tensors.items():
        raw = struct.pack("<%df" % len(values), *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(b):
    return {"bytes": len(b), "crc32": "%08x" % zlib.crc32(b)}


model = safetensors({"w": [0.5, -1.0, 2.0]}, {})
optimizer = safetensors({"m.0": [0.0, 0.1, 0.2], "v.0": [0.0, 0.01, 0.04]}, {"steps": "3"})
vocab = {"kind": "char", "tokens": ["<pad>", "<bos>", "<eos>", "<unk>", "a", "b"]}
config = json.dumps({
    "format": "attn-checkpoint-2", "task": "sort", "step": 3,
    "training": {"steps": 10, "lr": 0.001, "batch_size": 4,
                 "data": {"task": "sort", "seed": 1, "train_size": 100, "validation_size": 0, "test_size": 0}},
    "model": {"kind": "rnn", "src_vocab": 6, "tgt_vocab": 6, "embed_dim": 2, "hidden": 2, "attn_dim": 2,
              "layers": 1, "heads": 1, "dropout": 0.0, "seed": 1},
    "source_vocabulary": vocab, "target_vocabulary": vocab,
    "files": {"model.safetensors": entry(model), "optimizer.safetensors": entry(optimizer)},
}).encode()
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<BHH", 0, len(config), len(model)) + config + model + optimizer)
