#!/usr/bin/env python3
"""fedmesh's import of GPT-2's tokenizer files against GPT-2's own algorithm.

No GPT-2 files are downloaded: a BPE tokenizer is trained here (`fedmesh
tokenizer train`) on the Bible's first books and a Unicode stress text, then
written out exactly as GPT-2's files are (vocab.json with the 256 byte tokens
in GPT-2's order, merges.txt in GPT-2's byte alphabet, <|endoftext|> last).
`fedmesh tokenizer import` reads them, `fedmesh tokenizer encode` encodes the
texts, and the ids must equal those of GPT-2's encoder algorithm written here
in Python (the `regex` module with GPT-2's pattern, bytes_to_unicode, merges
by rank), token for token.

usage: check_gpt2_tokenizer.py FEDMESH WORKDIR
Exits 77 (meson's skip) without python3-regex.
"""
import json
import os
import subprocess
import sys

try:
    import regex
except ImportError:
    print("SKIP: no python3-regex (deploy/setup.sh installs it)")
    sys.exit(77)

GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

STRESS = (
    "It's the 3rd time I've said it: we'll see, they'd know, you're right, I'M LOUD, don't.\n"
    "\n\n  Indented   text\twith\ttabs  \r\n"
    "Numbers 3.14159, 1,000,000 and ½ ¾ ² Ⅷ ٣ ३ 10⁶ — dashes – and “quotes” ‘single’ «guillemets».\n"
    "Café naïve résumé Straße ÆØÅ ČŠŽ Ελληνικά Русский текст עברית العربية हिन्दी 日本語のテキスト 中文 한국어\n"
    "Emoji 🙂🚀 and 👨‍👩‍👧 family, combining e\u0301 a\u0308, zero\u200bwidth, nbsp\u00a0here, ideographic\u3000space.\n"
    "Trailing spaces   \n"
    "'quoted' 's start ''double'' 'sup 'll've\n"
    "    \n"
)


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs))), bs  # byte -> char, and GPT-2's order of the byte tokens


def gpt2_files(tokenizer, work):
    """GPT-2's vocab.json and merges.txt for a fedmesh tokenizer's merges."""
    byte_char, order = bytes_to_unicode()
    tokens = [bytes([b]) for b in range(256)]
    for first, second in tokenizer["merges"]:
        tokens.append(tokens[first] + tokens[second])
    text = lambda t: "".join(byte_char[b] for b in t)  # noqa: E731
    vocab = {}
    for i, b in enumerate(order):  # ids 0..255 in GPT-2's byte order
        vocab[text(bytes([b]))] = i
    for i in range(256, len(tokens)):
        vocab[text(tokens[i])] = i
    vocab["<|endoftext|>"] = len(tokens)
    merges = ["#version: 0.2"] + [f"{text(tokens[a])} {text(tokens[b])}" for a, b in tokenizer["merges"]]
    vocab_path, merges_path = os.path.join(work, "vocab.json"), os.path.join(work, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("\n".join(merges) + "\n")
    return vocab_path, merges_path, vocab, merges[1:]


def gpt2_encode(text, vocab, merges):
    """GPT-2's encoder: the regex's pieces, each byte-encoded, merged by rank."""
    byte_char, _ = bytes_to_unicode()
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    ids = []
    for piece in GPT2_PATTERN.findall(text):
        word = [byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((word[i], word[i + 1]), float("inf")), i) for i in range(len(word) - 1)]
            best = min(pairs)[0]
            if best == float("inf"):
                break
            first, second = merges[best].split(" ")
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids.extend(vocab[t] for t in word)
    return ids


def run(fedmesh, *args):
    result = subprocess.run([fedmesh, *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"fedmesh {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    fedmesh, work = sys.argv[1], sys.argv[2]
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    bible = subprocess.run(["bible", "-f", "Gen1:1-Gen12:20"], capture_output=True, text=True)
    genesis = bible.stdout if bible.returncode == 0 else ""
    with open(os.path.join(corpus, "genesis.txt"), "w", encoding="utf-8") as f:
        f.write(genesis)
    with open(os.path.join(corpus, "stress.txt"), "w", encoding="utf-8") as f:
        f.write(STRESS * 20)
    trained = os.path.join(work, "trained.json")
    run(fedmesh, "tokenizer", "train", "--data", corpus, "--vocab-size", "1200", "--out", trained)
    with open(trained) as f:
        tokenizer = json.load(f)
    vocab_path, merges_path, vocab, merges = gpt2_files(tokenizer, work)
    imported = os.path.join(work, "imported.json")
    print(run(fedmesh, "tokenizer", "import", "--vocab", vocab_path, "--merges", merges_path, "--out", imported).strip())

    failures = 0
    for name, text in [("Genesis 1-12", genesis), ("the Unicode stress text", STRESS)]:
        if not text:
            print(f"skipped {name}: no `bible` program")
            continue
        path = os.path.join(work, "text.txt")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        ours = json.loads(run(fedmesh, "tokenizer", "encode", "--tokenizer", imported, "--text", path))["ids"]
        theirs = gpt2_encode(text, vocab, merges)
        if ours == theirs:
            print(f"OK: {name}: {len(ours)} tokens for {len(text.encode())} bytes, the same as GPT-2's algorithm")
        else:
            failures += 1
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            print(f"FAIL: {name}: fedmesh {len(ours)} tokens, GPT-2's algorithm {len(theirs)}; first difference at "
                  f"token {at}: fedmesh {ours[at:at + 8]}, GPT-2 {theirs[at:at + 8]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
