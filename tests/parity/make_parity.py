#!/usr/bin/python3
"""Builds random PyTorch modules, runs them forward and backward in float64, and saves
weights, inputs, outputs and gradients as safetensors files that the C++ parity tests
(tests/nn_parity_test.cc) load and must reproduce within 1e-5 relative.

Each file holds
  param.<PyTorch name>        the module's weights (f32-representable values)
  in.<input>                  inputs; masks as BOOL or F32
  dout.<output>               the upstream gradient of each output (loss = Σ out·dout)
  out.<output>                outputs
  grad.<input>, grad.param.<name>   gradients
  f32err.<name>               for each output and gradient: ‖PyTorch's own float32 result −
                              the float64 one‖ (the same module and inputs run in float32)
and the case's configuration as JSON in the metadata key "config". The C++ side accepts an
error within 1e-5 relative, or within 4× f32err: a tensor of a few elements whose
value cancels (a one-query gradient, say) is ill-conditioned, and float32 arithmetic, ours
and PyTorch's alike, cannot meet 1e-5 of it.

Usage: make_parity.py OUT_DIR   (ATTN_TEST_SEED fixes the random draw; else a fresh one)
Runs with Debian's python3-torch (1.13) and NumPy; no other package.
"""
import copy
import json
import os
import random
import struct
import sys

import numpy as np
import torch
import torch.nn as nn

DTYPES = {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("bool"): "BOOL",
          np.dtype("int64"): "I64", np.dtype("int32"): "I32"}
# (record() stores integer inputs such as lengths as they are; they get no gradient.)


def save_safetensors(path, tensors, metadata):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def f32_values(t):
    """Rounds a float64 tensor's values to f32 (so both sides start from the same numbers)."""
    return t.float().double()


def randn(*shape):
    return f32_values(torch.randn(*shape, dtype=torch.float64))


def prepare(module):
    module.double().eval()  # eval: dropout off (attn's dropout stream differs from PyTorch's)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:  # biases and norm weights: random, so every gradient is exercised
                p.uniform_(-0.5, 0.5)
            p.copy_(f32_values(p))
    return module


def in_float32(x):
    """A float64 input as a float32 leaf (bool and integer inputs as they are)."""
    if x is None or not x.is_floating_point():
        return x
    return x.detach().float().requires_grad_(x.requires_grad)


def float32_errors(module, inputs, forward, douts, t):
    """Runs forward(module, inputs) again in float32 and returns f32err.<name> for every
    out.* and grad.* tensor in t (the float64 results)."""
    m32 = copy.deepcopy(module).float()
    m32.zero_grad(set_to_none=True)
    in32 = {name: in_float32(x) for name, x in inputs.items()}
    out32 = forward(m32, in32)
    sum((o * douts[name].float()).sum() for name, o in out32.items()).backward()
    got = {"out." + name: o for name, o in out32.items()}
    got.update({"grad." + name: x.grad for name, x in in32.items() if x is not None and x.requires_grad})
    got.update({"grad.param." + name: p.grad for name, p in m32.named_parameters()})
    return {"f32err." + name: np.array([np.linalg.norm(v.detach().double().numpy() - t[name])], dtype=np.float64)
            for name, v in got.items()}


def record(path, module, inputs, forward, config):
    """inputs: name -> tensor (float ones require grad); forward(module, inputs) -> outputs,
    name -> tensor. Runs it in float64 (the recorded results), and in float32 for f32err."""
    outputs = forward(module, inputs)
    douts = {name: randn(*o.shape) for name, o in outputs.items()}
    loss = sum((o * douts[name]).sum() for name, o in outputs.items())
    loss.backward()
    t = {}
    for name, p in module.named_parameters():
        t["param." + name] = p.detach().numpy()
        t["grad.param." + name] = p.grad.numpy()
    for name, x in inputs.items():
        if x is None:
            continue
        t["in." + name] = x.detach().numpy()
        if x.requires_grad:
            t["grad." + name] = x.grad.numpy()
    for name, o in outputs.items():
        t["out." + name] = o.detach().numpy()
        t["dout." + name] = douts[name].numpy()
    t.update(float32_errors(module, inputs, forward, douts, t))
    save_safetensors(path, t, {"config": json.dumps(config)})


def leaf(x):
    return x.clone().requires_grad_(True)


def padding_mask(B, S):
    """Boolean [B, S], True = ignore: a random tail of each row, keeping ≥ 1 key."""
    m = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        keep = random.randint(1, S)
        m[b, keep:] = True
    m[0, :] = False  # one batch without padding
    return m


def mha_cases(out):
    cases = [
        dict(name="basic", E=16, H=4, L=5, S=5, B=3, batch_first=False, self_attn=True),
        dict(name="batch_first_cross", E=12, H=3, L=4, S=7, B=2, batch_first=True, kpm="bool"),
        dict(name="kdim_vdim", E=8, H=2, L=3, S=6, B=2, batch_first=True, kdim=5, vdim=7, kpm="bool",
             attn_mask="bool2d"),
        # A float key_padding_mask is added (PyTorch ≥ 2.0's rule, and 1.13's when it is the only mask;
        # 1.13 mishandles a float one together with a float attn_mask, so that pair is not recorded).
        dict(name="float_masks_per_head", E=12, H=2, L=4, S=5, B=2, batch_first=False, kpm="bool",
             attn_mask="float3d", average=False),
        dict(name="float_padding", E=6, H=3, L=3, S=4, B=3, batch_first=True, kpm="float"),
        dict(name="causal_self", E=16, H=2, L=9, S=9, B=2, batch_first=True, self_attn=True, causal=True,
             kpm="bool_keep_first"),
        dict(name="one_head_odd", E=7, H=1, L=1, S=3, B=1, batch_first=False, need_weights=False),
    ]
    for c in cases:
        E, H, L, S, B = c["E"], c["H"], c["L"], c["S"], c["B"]
        kdim, vdim = c.get("kdim", E), c.get("vdim", E)
        m = prepare(nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=c["batch_first"]))
        shape = (lambda n, f: (B, n, f) if c["batch_first"] else (n, B, f))
        q = leaf(randn(*shape(L, E)))
        if c.get("self_attn"):
            k = v = q
        else:
            k, v = leaf(randn(*shape(S, kdim))), leaf(randn(*shape(S, vdim)))
        kpm = None
        if c.get("kpm") in ("bool", "bool_keep_first"):
            kpm = padding_mask(B, S)
            if c["kpm"] == "bool_keep_first":
                kpm[:, 0] = False  # causal: query 0 sees key 0 only
        elif c.get("kpm") == "float":
            kpm = randn(B, S)
        am = None
        if c.get("attn_mask") == "bool2d":
            am = torch.rand(L, S) < 0.3
            am[:, 0] = False  # key 0 (never padded) stays visible
        elif c.get("attn_mask") == "float3d":
            am = randn(B * H, L, S)
        torch_mask = am
        if c.get("causal"):
            torch_mask = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)
        need = c.get("need_weights", True)
        average = c.get("average", True)
        weights = []

        def forward(module, x, c=c, torch_mask=torch_mask, need=need, average=average, weights=weights):
            q = x["query"]
            k, v = (q, q) if c.get("self_attn") else (x["key"], x["value"])
            mask = torch_mask if torch_mask is None or torch_mask.dtype == torch.bool else x["attn_mask"]
            o, w = module(q, k, v, key_padding_mask=x["key_padding_mask"], need_weights=need, attn_mask=mask,
                          average_attn_weights=average)
            weights.append(w)
            return {"output": o}

        inputs = {"query": q}
        if not c.get("self_attn"):
            inputs.update(key=k, value=v)
        inputs.update(key_padding_mask=kpm, attn_mask=am)
        cfg = dict(c, kdim=kdim, vdim=vdim, need_weights=need, average=average)
        path = os.path.join(out, "mha_%s.safetensors" % c["name"])
        record(path, m, inputs, forward, cfg)
        if need:  # weights (of the float64 run) are compared, not differentiated
            load_and_add(path, {"out.weights": weights[0].detach().numpy()})


def load_and_add(path, more):
    """Rewrites a file with extra tensors (small files; simplest correct way)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__")
    inv = {v: k for k, v in DTYPES.items()}
    t = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        t[name] = np.frombuffer(data[b:end], dtype=inv[e["dtype"]]).reshape(e["shape"])
    t.update(more)
    save_safetensors(path, t, meta)


def transformer_cases(out):
    for norm_first in (False, True):
        for batch_first in (False, True):
            E, H, F, L, S, B = 12, 3, 20, 6, 5, 2
            shape = (lambda n: (B, n, E) if batch_first else (n, B, E))
            act = "gelu" if norm_first else "relu"
            enc = prepare(nn.TransformerEncoderLayer(E, H, F, dropout=0.1, activation=act, batch_first=batch_first,
                                                     norm_first=norm_first))
            src = leaf(randn(*shape(L)))
            kpm = padding_mask(B, L)
            cfg = dict(E=E, H=H, F=F, L=L, B=B, batch_first=batch_first, norm_first=norm_first, activation=act)
            record(os.path.join(out, "encoder_layer_nf%d_bf%d.safetensors" % (norm_first, batch_first)), enc,
                   {"src": src, "src_key_padding_mask": kpm},
                   lambda m, x: {"output": m(x["src"], src_key_padding_mask=x["src_key_padding_mask"])}, cfg)

            dec = prepare(nn.TransformerDecoderLayer(E, H, F, dropout=0.1, activation=act, batch_first=batch_first,
                                                     norm_first=norm_first))
            tgt, memory = leaf(randn(*shape(L))), leaf(randn(*shape(S)))
            causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
            mkpm = padding_mask(B, S)
            cfg = dict(cfg, S=S)
            record(os.path.join(out, "decoder_layer_nf%d_bf%d.safetensors" % (norm_first, batch_first)), dec,
                   {"tgt": tgt, "memory": memory, "memory_key_padding_mask": mkpm},
                   lambda m, x, causal=causal: {"output": m(x["tgt"], x["memory"], tgt_mask=causal,
                                                            memory_key_padding_mask=x["memory_key_padding_mask"])},
                   cfg)

    # Stacks with a final norm.
    E, H, F, L, S, B = 8, 2, 16, 4, 6, 3
    layer = nn.TransformerEncoderLayer(E, H, F, batch_first=True)
    enc = prepare(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=False))
    src = leaf(randn(B, L, E))
    record(os.path.join(out, "encoder_stack.safetensors"), enc, {"src": src}, lambda m, x: {"output": m(x["src"])},
           dict(E=E, H=H, F=F, L=L, B=B, layers=2, batch_first=True))
    layer = nn.TransformerDecoderLayer(E, H, F, batch_first=True, norm_first=True)
    dec = prepare(nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(E)))
    tgt, memory = leaf(randn(B, L, E)), leaf(randn(B, S, E))
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    record(os.path.join(out, "decoder_stack.safetensors"), dec, {"tgt": tgt, "memory": memory},
           lambda m, x: {"output": m(x["tgt"], x["memory"], tgt_mask=causal)},
           dict(E=E, H=H, F=F, L=L, S=S, B=B, layers=2, batch_first=True, norm_first=True))


def rnn_cases(out):
    for kind in ("GRU", "LSTM"):
        for batch_first in (False, True):
            I, Hd, L, B = 5, 7, 6, 3
            m = prepare(getattr(nn, kind)(I, Hd, num_layers=2, batch_first=batch_first, bidirectional=True))
            x = leaf(randn(*((B, L, I) if batch_first else (L, B, I))))
            h0 = leaf(randn(4, B, Hd))
            inputs = {"input": x, "h0": h0}
            if kind == "LSTM":
                inputs["c0"] = leaf(randn(4, B, Hd))

            def forward(m, x, kind=kind):
                if kind == "LSTM":
                    o, (hn, cn) = m(x["input"], (x["h0"], x["c0"]))
                    return {"output": o, "h_n": hn, "c_n": cn}
                o, hn = m(x["input"], x["h0"])
                return {"output": o, "h_n": hn}

            record(os.path.join(out, "%s_bf%d.safetensors" % (kind.lower(), batch_first)), m, inputs, forward,
                   dict(kind=kind, input_size=I, hidden_size=Hd, L=L, B=B, num_layers=2, bidirectional=True,
                        batch_first=batch_first))


def packed_cases(out):
    """Variable lengths through pack_padded_sequence: attn's `lengths` must agree."""
    for kind in ("GRU", "LSTM"):
        I, Hd, L, B = 4, 6, 7, 4
        m = prepare(getattr(nn, kind)(I, Hd, num_layers=2, batch_first=True, bidirectional=True))
        x = leaf(randn(B, L, I))
        lengths = torch.tensor([random.randint(1, L) for _ in range(B)])
        lengths[random.randrange(B)] = L  # pad_packed_sequence pads to the longest

        def forward(m, x, kind=kind, lengths=lengths, L=L):
            packed = nn.utils.rnn.pack_padded_sequence(x["input"], lengths, batch_first=True, enforce_sorted=False)
            if kind == "LSTM":
                o, (hn, cn) = m(packed)
                outputs = {"h_n": hn, "c_n": cn}
            else:
                o, hn = m(packed)
                outputs = {"h_n": hn}
            outputs["output"], _ = nn.utils.rnn.pad_packed_sequence(o, batch_first=True, total_length=L)
            return outputs

        record(os.path.join(out, "%s_packed.safetensors" % kind.lower()), m,
               {"input": x, "lengths": lengths.to(torch.int32)}, forward,
               dict(kind=kind, input_size=I, hidden_size=Hd, L=L, B=B, num_layers=2, bidirectional=True,
                    batch_first=True))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    seed = int(os.environ.get("ATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print("make_parity: seed %d (set ATTN_TEST_SEED to reproduce), torch %s" % (seed, torch.__version__))
    random.seed(seed)
    torch.manual_seed(seed)
    mha_cases(out)
    transformer_cases(out)
    rnn_cases(out)
    packed_cases(out)
    print("make_parity: wrote %d files to %s" % (len(os.listdir(out)), out))


if __name__ == "__main__":
    main()
