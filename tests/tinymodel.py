"""A tiny random-weights llama model as GGUF, so a real llama.cpp engine can serve on a CPU rig.

llama.cpp loads a `llama` architecture GGUF when it has the hyperparameters (context length,
embedding length, block count, feed-forward length, head counts, RoPE dimension, RMS epsilon),
every tensor of every block, and a tokenizer it can build a vocabulary from. The tokenizer here
is a SentencePiece-style one (`tokenizer.ggml.model = "llama"`): <unk> <s> </s>, all 256 byte
tokens <0x00>..<0xFF> (SPM falls back to them for any character it has no piece for, and looks
up <0x0A> as the newline token) and a few word pieces. The weights are seeded random numbers,
so the file, and its Hugging Face cache revision, are the same on every run.

A random model under a JSON grammar does not make a tool call: inside a string any character is
allowed, and it never picks the closing quote. `caller=True` writes the same shapes with weights
that make it one: each block's output is zero (the model sees only the current token), every
embedding is positive on one dimension and the output head reads only that dimension, for the
byte tokens `"` (most), `,` and `}`. Greedy under chatml-function-calling's grammar it closes each
string at once and ends the object: `{"city" :"",...}`; unconstrained it writes quotes.

    python -m tests.tinymodel OUT.gguf
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX = 2048
WORDS = ("hello", "world", "the", "a", "rig", "gpu", "serve", "model", "is", "up", "ok")

#: The fake hub repo the tests cache it under.
REPO = "local/tiny"
FILE = "tiny.gguf"


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the SPM vocabulary."""
    import gguf

    kinds = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"]
    types = [kinds.UNKNOWN, kinds.CONTROL, kinds.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [kinds.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [f"\u2581{word}" for word in WORDS]
    tokens += pieces
    types += [kinds.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: Path, seed: int = 0, *, caller: bool = False) -> Path:
    """Write the model to `path` (the same bytes for the same seed); `caller`: the docstring's
    tool-calling weights."""
    import gguf

    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def block_out(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32) if caller else weights(*shape)

    embeddings, head = weights(len(tokens), N_EMBD), weights(len(tokens), N_EMBD)
    if caller:
        embeddings[:, 0] = 1.0
        head[:] = 0.0
        for char, logit in (('"', 10.0), (",", 5.0), ("}", 5.0)):
            head[tokens.index(f"<0x{ord(char):02X}>"), 0] = logit

    head_dim = N_EMBD // N_HEAD
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("rigbook tiny test model")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    # numpy shapes are (rows, cols); GGUF stores them reversed, as llama.cpp expects.
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", ones(N_EMBD))
    writer.add_tensor("output.weight", head)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"{blk}.attn_q.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.attn_k.weight", weights(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"{blk}.attn_v.weight", weights(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"{blk}.attn_output.weight", block_out(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_down.weight", block_out(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def revision_of(path: Path) -> str:
    """A 40-hex 'commit' for the file: its sha1, so the same bytes get the same snapshot."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


def cache_layout(gguf_file: Path, revision: str) -> dict[str, str]:
    """Relative path -> what goes there, in Hugging Face hub cache layout (under HF_HUB_CACHE).

    `blobs/<sha256>` holds the bytes, `snapshots/<rev>/tiny.gguf` links to it, `refs/main`
    names the revision: what huggingface_hub itself leaves after a complete download.
    """
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    org, name = REPO.split("/")
    top = f"models--{org}--{name}"
    return {
        "blob": f"{top}/blobs/{sha}",
        "link": f"{top}/snapshots/{revision}/{FILE}",
        "target": f"../../blobs/{sha}",
        "ref": f"{top}/refs/main",
    }


def pull_manifest(gguf_file: Path, revision: str, allow: list[str]) -> bytes:
    """The manifest a completed rigbook pull of the tiny GGUF writes (files/models/pull.py) for
    the allow patterns its recipe asks (`gguf_patterns`; the caller passes them, so a kit run
    without rigbook installed can use this too)."""
    data = gguf_file.read_bytes()
    return json.dumps({
        "rigbook_manifest": 1, "repo": REPO, "revision": revision,
        "allow_patterns": allow, "ignore_patterns": [],
        "files": {FILE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
    }).encode()


if __name__ == "__main__":
    out = write_tiny_gguf(Path(sys.argv[1]))
    print(out, revision_of(out))
