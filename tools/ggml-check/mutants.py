#!/usr/bin/env python3
"""Writes broken copies of a GGUF file, each with one defect llama.cpp would trip over, so that
run.sh can show that ggml_check reports them (a checker that passes everything proves nothing).

    mutants.py IN.gguf OUTDIR        prints one line per mutant: NAME<TAB>PATH<TAB>what changed

Each mutant is a byte patch of the same length (or a truncation): the header stays parseable."""
import os
import struct
import sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def parse(buf):
    """Returns (kvs, tensors): kvs[key] = (type_offset, type, value_offset, arr_type_offset);
    tensors[name] = (name_offset, type_offset, ne)."""
    pos = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<qq", buf, pos)
    pos += 16

    def string(p):
        (n,) = struct.unpack_from("<Q", buf, p)
        return buf[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

    def skip_value(t, p):
        if t == 8:
            return string(p)[1]
        if t == 9:
            (at,) = struct.unpack_from("<i", buf, p)
            (n,) = struct.unpack_from("<Q", buf, p + 4)
            p += 12
            if at == 8:
                for _ in range(n):
                    p = string(p)[1]
                return p
            return p + n * SIZES[at]
        return p + SIZES[t]

    kvs = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<i", buf, pos)
        kvs[key] = (pos, t, pos + 4, pos + 4 if t == 9 else None)
        pos = skip_value(t, pos + 4)
    tensors = {}
    for _ in range(n_tensors):
        name_off = pos
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        ne = list(struct.unpack_from("<%dq" % nd, buf, pos + 4))
        pos += 4 + 8 * nd
        tensors[name] = (name_off + 8, pos, ne)
        pos += 4 + 8
    return kvs, tensors


def main():
    src, outdir = sys.argv[1], sys.argv[2]
    data = open(src, "rb").read()
    kvs, tensors = parse(data)
    os.makedirs(outdir, exist_ok=True)
    out = []

    def emit(name, what, patch=None, truncate=None):
        buf = bytearray(data)
        if patch:
            patch(buf)
        if truncate:
            buf = buf[:len(buf) - truncate]
        path = os.path.join(outdir, "mutant-%s.gguf" % name)
        open(path, "wb").write(buf)
        out.append("%s\t%s\t%s" % (name, path, what))

    def set_i32(off, v):
        return lambda b: struct.pack_into("<i", b, off, v)

    tt = kvs["tokenizer.ggml.token_type"]
    emit("token-type-u32", "tokenizer.ggml.token_type stored as a u32 array", set_i32(tt[3], 4))
    ff = kvs["qwen3moe.expert_feed_forward_length"]
    emit("expert-ff-i32", "qwen3moe.expert_feed_forward_length stored as i32", set_i32(ff[0], 5))
    eps = kvs["qwen3moe.attention.layer_norm_rms_epsilon"]
    emit("eps-u32", "qwen3moe.attention.layer_norm_rms_epsilon stored as u32", set_i32(eps[0], 4))

    def rename(old, new):
        def f(b):
            i = b.find(old.encode())
            b[i:i + len(old)] = new.encode()
        return f

    emit("pre-qwen3", "tokenizer.ggml.pre = 'qwen3'", rename('\x05\x00\x00\x00\x00\x00\x00\x00qwen2',
                                                            '\x05\x00\x00\x00\x00\x00\x00\x00qwen3'))
    emit("no-rope-base", "key qwen3moe.rope.freq_base renamed (llama.cpp would use 10000)",
         rename("qwen3moe.rope.freq_base", "qwen3moe.rope.freq_bas_"))
    # Token 1 becomes a copy of token 0 when both are one byte long ('!' and '"' in Qwen's BPE).
    def dup_token(b):
        p = kvs["tokenizer.ggml.tokens"][2] + 4 + 8  # element type, count
        (n0,) = struct.unpack_from("<Q", b, p)
        (n1,) = struct.unpack_from("<Q", b, p + 8 + n0)
        assert n0 == n1 == 1
        b[p + 8 + n0 + 8] = b[p + 8]
    emit("duplicate-token", "token 1 has the same text as token 0", dup_token)
    no = tensors["blk.0.attn_q_norm.weight"][0]
    emit("tensor-renamed", "tensor blk.0.attn_q_norm renamed blk.0.attn_x_norm",
         lambda b: b.__setitem__(slice(no, no + 24), b"blk.0.attn_x_norm.weight"))
    to = tensors["blk.0.attn_q.weight"][1]
    (t,) = struct.unpack_from("<i", data, to)
    # Same block size and bytes, a type ggml knows but moed does not compute (F16 -> I16,
    # Q4_0 -> IQ4_NL): both readers accept the file, the dequantize comparison must object.
    other = {1: 25, 2: 20}.get(t)
    if other is not None:
        emit("type-noncompute", "blk.0.attn_q type %d -> %d (same block bytes)" % (t, other),
             set_i32(to, other))
    emit("truncated", "last 8 bytes cut off (tensor data / trailing padding)", truncate=8)
    print("\n".join(out))


if __name__ == "__main__":
    main()
