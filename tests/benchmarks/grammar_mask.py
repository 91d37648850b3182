"""Grammar engines for structured output, compared: `python -m tests.benchmarks.grammar_mask`.

What it measures, for llguidance and xgrammar (both must be installed):

- **mask cost**: microseconds to compute the allowed-token mask for one decode step
  (median, 95th percentile and maximum over every step of the documents below), on a
  Llama-2-style 32,000-token vocabulary (SentencePiece-like BPE over `▁`, byte fallback)
  and a Qwen/Llama-3-style 150,000-token byte-level BPE. Both vocabularies are trained
  here with the `tokenizers` library on generated text (no downloads) and kept in
  `--vocab-dir` for the next run. Each step computes the mask, then feeds the
  document's next token (the documents' tokens are llguidance's greedy tokenization,
  fed identically to both engines). Engines alternate document by document, so a slow
  spell of a shared machine hits both alike. Also: grammar compile time per schema and
  tokenizer set-up time, and what turning a mask into MLX logits costs (`apply_us`).
- **schema coverage**: for each JSON-Schema feature, whether the engine refuses the
  schema (an error at compile time), or accepts it; an accepted schema is then sampled
  `--samples` times (a random walk over the allowed tokens that favours closing
  characters) and every finished document is checked with `jsonschema` (formats
  included): `enforced` when all validate, `NOT enforced k/n` when k of n did not.

The load average is printed with the numbers: on a shared machine they only compare
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# ---- vocabularies ------------------------------------------------------------------------

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t",
           "v", "w", "x", "y", "z", "br", "cl", "dr", "fl", "gr", "pl", "st", "sh", "ch", "th",
           "tr", "sp"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "ng", "nd", "st", "ck", "x", "rk", "sh", "th"]
_PUNCT = [".", ",", "!", "?", ":", ";", '"', "(", ")", "{", "}", "[", "]", "-", "_", "/",
          "'", "\n", "\n\n", "    ", "\t", '{"', '":', '",', "},", "],"]


def corpus(n_words: int, seed: int = 0) -> list[str]:
    """Lines of pseudo-words with a Zipf-like frequency, numbers and punctuation: enough
    distinct words for a 150k vocabulary to fill up."""
    rnd = random.Random(seed)
    sylls = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    rnd.shuffle(sylls)
    lexicon = []
    for i in range(400_000):
        pool = sylls[: 200 + i // 50]
        word = "".join(rnd.choice(pool) for _ in range(rnd.choice((1, 2, 2, 3, 3, 4))))
        lexicon.append(word.capitalize() if rnd.random() < 0.1 else word)
    cum = np.cumsum([1.0 / (i + 10) ** 0.9 for i in range(len(lexicon))])
    picks = np.searchsorted(cum, np.random.default_rng(seed).random(n_words) * cum[-1])
    lines, line = [], []
    for k in picks:
        r = rnd.random()
        if r < 0.05:
            line.append(str(rnd.randint(0, 10 ** rnd.randint(1, 6))))
        elif r < 0.12:
            line.append(rnd.choice(_PUNCT))
        line.append(lexicon[k])
        if len(line) > 40:
            lines.append(" ".join(line))
            line = []
    return lines


def llama2_style(texts: list[str], size: int) -> Any:
    """BPE over `▁`-marked words with byte fallback (<0x00>..<0xFF>), as Llama 2's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=specials, show_progress=False, limit_alphabet=200))
    return tok


def byte_level(texts: list[str], size: int) -> Any:
    """GPT-2-style byte-level BPE (the Llama 3 / Qwen kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


VOCABS: dict[str, tuple[Callable[[list[str], int], Any], int, str]] = {
    "llama2-32k": (llama2_style, 32_000, "</s>"),
    "bytelevel-150k": (byte_level, 150_000, "<|endoftext|>"),
}


def vocabulary(name: str, folder: Path, words: int) -> tuple[str, int, int]:
    """(tokenizer.json text, vocabulary size, EOS id), trained once into `folder`."""
    build, size, eos = VOCABS[name]
    path = folder / f"{name}.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tok = build(corpus(words), size)
        tok.save(str(path))
        print(f"# trained {name} in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return path.read_text(), tok.get_vocab_size(), tok.token_to_id(eos)


# ---- schemas and documents -------------------------------------------------------------

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["person", "animal", "place"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "kind", "address"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}  # response_format json_object

MASK_CASES: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "record": (RECORD, [
        {"name": "Lily the brave explorer", "age": 31, "tags": ["forest", "river", "top"],
         "kind": "person", "address": {"city": "Springfield", "zip": "12345"}, "score": 0.5},
        {"name": "Rex", "age": 4, "tags": [], "kind": "animal", "address": {"city": "Paris"}},
    ]),
    "json_object": (ANY_OBJECT, [
        {"story": "Once upon a time there was a little girl named Lily.", "n": [1, 2.5, -3],
         "ok": True, "none": None, "nested": {"a": {"b": {"c": ["x", "y", {"d": 1e5}]}}}},
        {"id": 12345, "title": "A dragon and a knight", "chapters": [
            {"n": 1, "words": 1200}, {"n": 2, "words": 980}], "draft": False},
    ]),
}

# (feature, schema): one JSON-Schema feature each, on top of a plain object
FEATURES: list[tuple[str, dict[str, Any]]] = [
    ("type: string/number/integer/boolean/null", {
        "type": "object", "properties": {
            "s": {"type": "string"}, "n": {"type": "number"}, "i": {"type": "integer"},
            "b": {"type": "boolean"}, "z": {"type": "null"}},
        "required": ["s", "n", "i", "b", "z"], "additionalProperties": False}),
    ("type list [string, null]", {"type": "object", "properties": {
        "x": {"type": ["string", "null"]}}, "required": ["x"], "additionalProperties": False}),
    ("enum / const", {"type": "object", "properties": {
        "e": {"enum": ["red", 1, None]}, "c": {"const": "fixed"}},
        "required": ["e", "c"], "additionalProperties": False}),
    ("required + additionalProperties: false", RECORD),
    ("additionalProperties: schema", {"type": "object",
                                      "additionalProperties": {"type": "integer"}}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "k": {"type": "string"}}, "required": ["k"], "additionalProperties": False}]}),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 10},
                         {"type": "integer", "maximum": 5}]}),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]},
                         {"properties": {"a": {"minimum": 3}}}]}),
    ("$ref / $defs", {"$defs": {"p": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}},
        "type": "array", "items": {"$ref": "#/$defs/p"}}),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                            "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
    ("minLength / maxLength", {"type": "string", "minLength": 3, "maxLength": 5}),
    ("pattern", {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{3}$"}),
    ("format: date-time", {"type": "string", "format": "date-time"}),
    ("format: date", {"type": "string", "format": "date"}),
    ("format: email", {"type": "string", "format": "email"}),
    ("format: uuid", {"type": "string", "format": "uuid"}),
    ("format: ipv4", {"type": "string", "format": "ipv4"}),
    ("format: uri", {"type": "string", "format": "uri"}),
    ("minimum / maximum (integer)", {"type": "integer", "minimum": -5, "maximum": 250}),
    ("exclusiveMinimum / exclusiveMaximum (number)", {
        "type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("multipleOf", {"type": "integer", "multipleOf": 7}),
    ("minItems / maxItems", {"type": "array", "items": {"type": "integer"},
                             "minItems": 2, "maxItems": 3}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}),
    ("prefixItems + items: false", {"type": "array", "prefixItems": [
        {"type": "string"}, {"type": "integer"}], "items": False}),
    ("contains", {"type": "array", "items": {"type": "integer"},
                  "contains": {"const": 7}}),
    ("minProperties / maxProperties", {"type": "object", "additionalProperties": {
        "type": "integer"}, "minProperties": 1, "maxProperties": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {
        "^x_": {"type": "integer"}}, "additionalProperties": False}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
                       "additionalProperties": {"type": "integer"}}),
    ("dependentRequired", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]}}),
    ("if / then / else", {"type": "object", "properties": {"k": {"enum": ["n", "s"]}},
                          "required": ["k"],
                          "if": {"properties": {"k": {"const": "n"}}},
                          "then": {"properties": {"v": {"type": "integer"}},
                                   "required": ["v"]}}),
    ("not", {"type": "integer", "not": {"const": 3}}),
]


# ---- the engines, behind one small interface --------------------------------------------

class Llg:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int) -> None:
        import llguidance as llg

        self.llg = llg
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.n_vocab = n_vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self) -> np.ndarray:
        return np.full((1, (self.n_vocab + 31) // 32), -1, dtype=np.int32)

    def fill(self, m: Any, bm: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(m, bm)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_accepting()


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int) -> None:
        import torch
        import xgrammar as xgr
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.torch = xgr, torch
        t0 = time.perf_counter()
        hf = Tokenizer.from_str(tokenizer_json)
        fast = PreTrainedTokenizerFast(tokenizer_object=hf)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=n_vocab,
                                                  stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.n_vocab = n_vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(",", ":"), strict_mode=True)
        return self.xgr.GrammarMatcher(cg)

    def bitmask(self) -> Any:
        return self.xgr.allocate_token_bitmask(1, self.n_vocab)

    def fill(self, m: Any, bm: Any) -> None:
        m.fill_next_token_bitmask(bm)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_completed() if hasattr(m, "is_completed") else m.is_terminated()


def _words(bm: Any) -> np.ndarray:
    return bm.numpy()[0] if hasattr(bm, "numpy") else bm[0]


def _allowed(bm: Any, n_vocab: int) -> np.ndarray:
    bits = np.unpackbits(_words(bm).view(np.uint8), bitorder="little")[:n_vocab]
    return np.flatnonzero(bits)


# ---- measurements -----------------------------------------------------------------------

def mask_cost(engines: list[Any], token_docs: dict[str, list[list[int]]],
              schemas: dict[str, dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for case, docs in token_docs.items():
        steps: dict[str, list[float]] = {e.name: [] for e in engines}
        compiles: dict[str, list[float]] = {e.name: [] for e in engines}
        for _ in range(rounds):
            for ids in docs:
                for e in engines:  # interleaved: a busy spell hits both
                    t0 = time.perf_counter()
                    m = e.compile(schemas[case])
                    compiles[e.name].append(time.perf_counter() - t0)
                    bm = e.bitmask()
                    for tok in ids:
                        t0 = time.perf_counter()
                        e.fill(m, bm)
                        steps[e.name].append(time.perf_counter() - t0)
                        if not e.accept(m, tok):
                            raise AssertionError(f"{e.name} refused a valid document ({case})")
        for e in engines:
            s = steps[e.name]
            rows.append({"case": case, "engine": e.name, "steps": len(s),
                         "median_us": statistics.median(s) * 1e6,
                         "p95_us": float(np.percentile(s, 95)) * 1e6, "max_us": max(s) * 1e6,
                         "compile_ms": statistics.median(compiles[e.name]) * 1e3})
    return rows


def apply_cost(n_vocab: int, rounds: int = 200) -> float:
    """Microseconds to turn a packed bitmask into masked MLX logits (1, V) and take the
    argmax, as the decode loop does (model/runtime/constrained.py's mask_logits), less
    the argmax alone."""
    import mlx.core as mx

    from kvchat.model.runtime.constrained import mask_logits

    words = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (n_vocab + 31) // 32,
                                              dtype=np.int64).astype(np.int32)
    logits = mx.random.normal((1, n_vocab))
    bits = mx.array([1 << i for i in range(32)], dtype=mx.uint32)
    mx.eval(logits, bits)
    masked, plain = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval(mx.argmax(mask_logits(logits, words, n_vocab, bits), axis=-1))
        t1 = time.perf_counter()
        mx.eval(mx.argmax(logits, axis=-1))
        masked.append(t1 - t0)
        plain.append(time.perf_counter() - t1)
    return (statistics.median(masked) - statistics.median(plain)) * 1e6


_CLOSERS = b'"}],'


def random_walk(e: Any, schema: dict[str, Any], rnd: random.Random, token_bytes: list[bytes],
                max_steps: int) -> bytes | None:
    """One document from random allowed tokens, favouring single closing characters."""
    m = e.compile(schema)
    bm = e.bitmask()
    closers = {i for i, b in enumerate(token_bytes) if len(b) == 1 and b in _CLOSERS}
    singles = {i for i, b in enumerate(token_bytes) if len(b) == 1}
    out = b""
    for _ in range(max_steps):
        if e.done(m):
            return out
        e.fill(m, bm)
        allowed = [int(t) for t in _allowed(bm, e.n_vocab) if token_bytes[t]]
        if not allowed:
            return out if e.done(m) else None
        r = rnd.random()
        pool = ([t for t in allowed if t in closers] if r < 0.3 else
                [t for t in allowed if t in singles] if r < 0.8 else allowed) or allowed
        tok = rnd.choice(pool)
        if not e.accept(m, tok):
            return None
        out += token_bytes[tok]
    return out if e.done(m) else None


def coverage(engines: list[Any], token_bytes: list[bytes], samples: int,
             max_steps: int) -> list[dict[str, Any]]:
    import jsonschema

    rows = []
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for feature, schema in FEATURES:
        validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
        # jsonschema checks some formats only with optional packages installed
        unchecked = schema.get("format") not in (None, *checker.checkers)
        row: dict[str, Any] = {"feature": feature}
        for e in engines:
            try:
                e.compile(schema)
            except Exception as err:  # noqa: BLE001 - any refusal is the finding
                row[e.name] = "refused: " + " ".join(str(err).split())[:90]
                continue
            rnd = random.Random(0)
            bad = done = 0
            for _ in range(samples * 3):
                doc = random_walk(e, schema, rnd, token_bytes, max_steps)
                if doc is None:
                    continue
                done += 1
                try:
                    ok = validator.is_valid(json.loads(doc))
                except ValueError:
                    ok = False
                bad += not ok
                if done == samples:
                    break
            row[e.name] = (f"no document finished in {max_steps} tokens" if not done else
                           f"accepted ({done} documents; jsonschema cannot check this"
                           " format here)" if unchecked else
                           f"enforced ({done}/{done} valid)" if not bad else
                           f"NOT enforced: {bad}/{done} invalid")
        rows.append(row)
    return rows


def token_bytes_of(tokenizer_json: str) -> list[bytes]:
    """The bytes each id spells (special tokens: none), for the random walk."""
    import llguidance as llg

    tok = llg.LLTokenizer(tokenizer_json)
    return [b"" if tok.is_special_token(i) else tok.decode_bytes([i])
            for i in range(tok.vocab_size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.grammar_mask",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "kvchat-grammar-vocabs")
    p.add_argument("--words", type=int, default=3_000_000,
                   help="words of generated text the vocabularies are trained on")
    p.add_argument("--rounds", type=int, default=3, help="passes over the documents")
    p.add_argument("--samples", type=int, default=20, help="documents per coverage check")
    p.add_argument("--max-steps", type=int, default=200, help="tokens per sampled document")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)

    load_before = os.getloadavg()
    results: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_before": load_before,
                               "mask": [], "setup": [], "apply_us": {}, "coverage": []}
    schemas = {case: schema for case, (schema, _) in MASK_CASES.items()}
    for vocab in VOCABS:
        text, n_vocab, eos = vocabulary(vocab, args.vocab_dir, args.words)
        engines = [Llg(text, n_vocab, eos), Xgr(text, n_vocab, eos)]
        for e in engines:
            results["setup"].append({"vocab": vocab, "engine": e.name, "seconds": e.setup_s})
        greedy = engines[0].tok.greedy_tokenize
        token_docs = {case: [greedy(json.dumps(d, separators=(",", ":"))) for d in docs]
                      for case, (_, docs) in MASK_CASES.items()}
        for row in mask_cost(engines, token_docs, schemas, args.rounds):
            results["mask"].append({"vocab": vocab, "n_vocab": n_vocab, **row})
        results["apply_us"][vocab] = apply_cost(n_vocab)
        if vocab == "llama2-32k":
            results["coverage"] = coverage(engines, token_bytes_of(text), args.samples,
                                           args.max_steps)
    results["loadavg_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{results['cpus']} CPUs, load average {load_before[0]:.1f} before,"
          f" {results['loadavg_after'][0]:.1f} after\n")
    print("| vocabulary | schema | engine | mask median µs | p95 µs | max µs | compile ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in results["mask"]:
        print(f"| {r['vocab']} ({r['n_vocab']:,}) | {r['case']} | {r['engine']} |"
              f" {r['median_us']:.1f} | {r['p95_us']:.1f} | {r['max_us']:.0f} |"
              f" {r['compile_ms']:.1f} |")
    print("\n| vocabulary | engine | tokenizer set-up s |\n|---|---|---:|")
    for r in results["setup"]:
        print(f"| {r['vocab']} | {r['engine']} | {r['seconds']:.2f} |")
    print("\nmask -> MLX logits: " + ", ".join(
        f"{v} {us:.0f} µs" for v, us in results["apply_us"].items()))
    names = [Llg.name, Xgr.name]
    print(f"\n| feature | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for r in results["coverage"]:
        print(f"| {r['feature']} | " + " | ".join(r[n] for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
