"""Grammar libraries for structured output (#20), measured on CPU with the embedded SmolLM2 tokenizer (V = 49152):
xgrammar, llguidance and outlines-core, each through its own Python API, the way an engine drives it.

Cases: three JSON schemas (a nested object, an array of enums, an object holding a string with a pattern), a larger
object with optional fields (json_profile: compile time, not part of the choice), a regex (a date) and a choice
list (a regex alternation of the escaped strings). JSON is compact in every library (", " and ": " separators, no
free whitespace: xgrammar any_whitespace=False, llguidance whitespace_flexible=False; outlines-core's default
`[ ]?` is the closest it offers).

Per library and case:
* compile_s: one fresh compile, median of --compiles (xgrammar with its cache off; llguidance builds lazily, so its
  figure is the grammar, a template matcher and that matcher's first mask; outlines-core builds its regex index over
  the whole vocabulary). `setup_s`: the tokenizer wrapper each library builds once.
* mask: --n fresh matchers decode a valid instance in lockstep: per step the [n, ceil(V/32)] int32 bitmask is
  filled row by row through the library's single-matcher call (what engine/structured.GrammarMatcher.fill_bitmask
  does), then every matcher accepts the instance's next token. Each round runs every library, order rotated; per
  step the median over rounds; `mask_step_ms` is the mean step (all n rows), `mask_step_max_ms` the slowest step,
  `mask_us_per_seq` the mean step over n. `accept_us_per_seq` likewise; `matcher_us` one matcher's construction.
* allowed: the mean number of allowed tokens in row 0 over the steps.
Keyword conformance: per library, schemas probing one keyword each, with an instance that breaks it and one that
satisfies it: "enforced", "ignored" (the breaking instance is taken: output that does not validate), "refused"
(compile error), "+rejects_valid". COMMON are the keywords pydantic emits for everyday constraints; EXTRA rarer ones.
Then the bitmask application on [n, V] fp32 logits: engine.structured.apply_bitmask (a torch unpack) and, as a
reference, xgrammar's CPU kernel.

Choice: the lowest mask_us_per_seq summed over the three JSON schemas, among the libraries that compile every case
and enforce every COMMON keyword. Prints one JSON line and writes bench/results/structured.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch

from bench.report import parse_bench_args, rotated, write_result
from service.tokens import gpt2_byte_decoder  # the one copy of GPT-2's byte alphabet
from engine.structured import apply_bitmask, choice_regex


NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ENUM_ARRAY = {"type": "array", "minItems": 1, "maxItems": 4,
              "items": {"type": "string", "enum": ["red", "green", "blue"]}}
PATTERN = {"type": "object", "additionalProperties": False, "required": ["sku"],
           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}}
# Not one of the three named schemas: a larger object with optional fields, to show how compile time grows.
PROFILE = {"type": "object", "required": ["id", "name"],
           "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
                          "email": {"type": "string", "format": "email"},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
                          "address": {"type": "object", "required": ["street", "city"],
                                      "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "active": {"type": "boolean"},
                          "score": {"type": "number"}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral"]

_INT = {"type": "integer"}
# Keyword probes: (name, schema, an instance that breaks the keyword, one that satisfies it). COMMON holds what
# pydantic emits for everyday constraints; a library that accepts a breaking instance of one of these does not
# support JSON schema in the sense of the choice below. EXTRA are rarer keywords, reported only.
COMMON = [
    ("required", {"type": "object", "properties": {"a": _INT, "b": _INT}, "required": ["b"]}, '{"a": 1}', '{"b": 1}'),
    ("additionalProperties", {"type": "object", "properties": {"a": _INT}, "additionalProperties": False},
     '{"a": 1, "b": 2}', '{"a": 1}'),
    ("enum", {"enum": ["a", "b", 1]}, '"c"', "1"),
    ("const", {"const": "a"}, '"b"', '"a"'),
    ("minLength", {"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    ("maxLength", {"type": "string", "maxLength": 3}, '"abcd"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, '"AB-1"', '"ABC-1234"'),
    ("minimum", {"type": "integer", "minimum": 5}, "3", "7"),
    ("maximum", {"type": "integer", "maximum": 150}, "151", "36"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0", "0.5"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "3", "10"),
    ("minItems", {"type": "array", "items": _INT, "minItems": 2}, "[1]", "[1, 2]"),
    ("maxItems", {"type": "array", "items": _INT, "maxItems": 1}, "[1, 2]", "[1]"),
    ("anyOf", {"anyOf": [_INT, {"type": "string"}]}, "true", '"x"'),
    ("nullable", {"type": ["integer", "null"]}, '"x"', "null"),
    ("$ref", {"$defs": {"x": _INT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"]},
     '{"a": "s"}', '{"a": 1}'),
]
EXTRA = [
    ("not", {"not": {"type": "string"}}, '"x"', "1"),
    ("uniqueItems", {"type": "array", "items": _INT, "uniqueItems": True}, "[1, 1]", "[1, 2]"),
    ("if_then", {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, "7", "3"),
    ("contains", {"type": "array", "contains": {"const": 5}}, "[1]", "[5]"),
    ("maxProperties", {"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("oneOf", {"oneOf": [_INT, {"type": "number"}]}, "3", "3.5"),
    ("additionalProperties_true", {"type": "object", "properties": {"a": _INT}}, '{"a": "x"}', '{"a": 1, "b": 2}'),
]

# (name, kind, spec, a valid instance whose tokens drive the matchers mid-way)
CASES = [
    ("json_nested", "json", NESTED, json.dumps({"name": "Ada Byron", "address": {"city": "London", "zip": "01234"}})),
    ("json_enum_array", "json", ENUM_ARRAY, json.dumps(["red", "blue", "green"])),
    ("json_pattern", "json", PATTERN, json.dumps({"sku": "ABC-1234"})),
    ("json_profile", "json", PROFILE, json.dumps({"id": 7, "name": "Ada", "tags": ["math"],
                                                  "address": {"street": "Main St", "city": "Paris"}, "age": 36})),
    ("regex_date", "regex", DATE, "2024-05-17"),
    ("choice", "choice", CHOICES, "neutral"),
]
JSON_CASES = ["json_nested", "json_enum_array", "json_pattern"]  # the choice is made on these three
QUICK = dict(n=4, rounds=1, compiles=1, cases=[*JSON_CASES, "regex_date", "choice"])


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, threads: int = 1):
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)

    def compile(self, kind: str, spec):
        c = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        return c.compile_regex(spec if kind == "regex" else choice_regex(spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def can_end(self, m) -> bool:
        return m.is_completed()


class LLGuidance:
    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tokenizer, vocab: int, threads: int = 1):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(spec, overrides=self.OPTIONS)
        else:
            grammar = M.grammar_from_regex(spec if kind == "regex" else choice_regex(spec))
        template = M(self.tok, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        template.deep_copy().compute_bitmask()  # the parser is built lazily: the first mask is part of the compile
        return template

    def matcher(self, template):
        return template.deep_copy()  # as engine/structured does: cheaper than a matcher from the grammar text

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, row)

    def can_end(self, m) -> bool:
        return m.is_accepting()


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tokenizer, vocab: int, threads: int = 1):
        import outlines_core as oc
        self.oc = oc
        decoder = gpt2_byte_decoder()
        special = set(tokenizer.all_special_ids)
        table: dict[bytes, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i not in special and i != tokenizer.eos_token_id:
                table.setdefault(bytes(decoder[ch] for ch in token), []).append(i)
        self.vocabulary = oc.Vocabulary(tokenizer.eos_token_id, table)

    def compile(self, kind: str, spec):
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        else:
            regex = spec if kind == "regex" else choice_regex(spec)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def accept(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask[row]
        m.write_mask_into(r.data_ptr(), r.numel(), r.element_size())

    def can_end(self, m) -> bool:
        return m.is_finished()


LIBRARIES: dict[str, Callable] = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def replay(lib, compiled, ids: list[int], n: int, vocab: int) -> dict:
    """One round: n fresh matchers decode the instance in lockstep; per step all n rows are filled, then every
    matcher accepts the instance's next token. Seconds per step for both, and mean allowed tokens of row 0."""
    t0 = time.perf_counter()
    matchers = [lib.matcher(compiled) for _ in range(n)]
    matcher_s = time.perf_counter() - t0
    bitmask = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32)
    fill, accept, allowed = [], [], []
    for pos, token in enumerate(ids):
        fill.append(timed(lambda: [lib.fill(m, bitmask, row) for row, m in enumerate(matchers)]))
        allowed.append(popcount(bitmask[0], vocab))
        t0 = time.perf_counter()
        ok = [lib.accept(m, token) for m in matchers]
        accept.append(time.perf_counter() - t0)
        if not all(ok):
            raise ValueError(f"the instance's token {pos} ({token}) was refused")
    return {"matcher_s": matcher_s, "fill_s": fill, "accept_s": accept, "allowed": sum(allowed) / len(allowed)}


def popcount(row: torch.Tensor, vocab: int) -> int:
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return int(bits.flatten()[:vocab].sum())


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(rounds: list[dict], n: int) -> dict:
    """Per-step figures: medians over rounds of each step, then the mean (and the slowest) over the steps."""
    steps = len(rounds[0]["fill_s"])
    fill = [statistics.median(r["fill_s"][i] for r in rounds) for i in range(steps)]
    accept = [statistics.median(r["accept_s"][i] for r in rounds) for i in range(steps)]
    return {"tokens": steps, "mask_step_ms": statistics.fmean(fill) * 1e3, "mask_step_max_ms": max(fill) * 1e3,
            "mask_us_per_seq": statistics.fmean(fill) * 1e6 / n,
            "accept_us_per_seq": statistics.fmean(accept) * 1e6 / n,
            "matcher_us": statistics.median(r["matcher_s"] for r in rounds) * 1e6 / n,
            "allowed": rounds[0]["allowed"]}


def accepts(lib, compiled, ids: list[int]) -> bool:
    """Whether the grammar takes exactly these tokens (then may end)."""
    m = lib.matcher(compiled)
    return all(lib.accept(m, t) for t in ids) and lib.can_end(m)


def conformance(lib, tokenizer, probes) -> dict:
    """Per probe: "enforced", "refused: <error>", "ignored" (took the breaking instance), and "+rejects_valid"."""
    out = {}
    for name, schema, bad, good in probes:
        try:
            compiled = lib.compile("json", schema)
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            out[name] = "refused: " + " ".join(str(e).split())[:120]
            continue
        enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        verdict = "ignored" if accepts(lib, compiled, enc(bad)) else "enforced"
        out[name] = verdict if accepts(lib, compiled, enc(good)) else verdict + "+rejects_valid"
    return out


def compile_times(lib, cases: list[tuple], compiles: int) -> tuple[dict, dict]:
    """Per case: the median seconds of `compiles` fresh compiles (or the library's error), and the last compiled."""
    out, compiled = {}, {}
    for name, kind, spec, _ in cases:
        times = []
        try:
            for _ in range(compiles):
                t0 = time.perf_counter()
                compiled[name] = lib.compile(kind, spec)
                times.append(time.perf_counter() - t0)
            out[name] = {"compile_s": statistics.median(times)}
        except Exception as e:  # noqa: BLE001 - a library that cannot compile a case is a finding, not a crash
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out, compiled


def measure_library(lib, tokenizer, cases: list[tuple], compiles: int) -> tuple[dict, dict]:
    """Compile figures per case and the compiled grammars whose instance replays (name -> (compiled, token ids))."""
    figures, compiled = compile_times(lib, cases, compiles)
    ready = {}
    for name, _, _, instance in cases:
        if name not in compiled:
            continue
        ids = tokenizer.encode(instance, add_special_tokens=False)
        try:
            replay(lib, compiled[name], ids, 1, len(tokenizer))
            ready[name] = (compiled[name], ids)
        except ValueError as e:
            figures[name]["error"] = f"instance {instance!r}: {e}"
    return figures, ready


def mid_json_bitmask(n: int, vocab: int, tokenizer) -> torch.Tensor:
    """A realistic bitmask to apply: n rows of the nested schema at spread positions (engine.structured fills it)."""
    from engine.config import StructuredOutputsParams
    from engine.structured import GrammarCompiler, allocate_bitmask
    compiler = GrammarCompiler(tokenizer, vocab)
    compiled = compiler.compile(StructuredOutputsParams(json=NESTED))
    ids = tokenizer.encode(CASES[0][3], add_special_tokens=False)
    bitmask = allocate_bitmask(n, vocab)
    for row in range(n):
        m = compiler.matcher(compiled)
        for t in ids[:row % len(ids)]:
            m.accept(t)
        m.fill_bitmask(bitmask, row)
    return bitmask


def apply_figures(bitmask: torch.Tensor, vocab: int, rounds: int) -> dict:
    """ms to mask [n, V] fp32 logits: engine.structured.apply_bitmask, and xgrammar's CPU kernel for reference."""
    systems = {"engine_apply_bitmask": apply_bitmask}
    try:
        import xgrammar as xgr
        systems["xgrammar_cpu_kernel"] = lambda lg, bm: xgr.apply_token_bitmask_inplace(lg, bm, vocab_size=vocab)
    except ImportError:
        pass
    logits = torch.randn(bitmask.shape[0], vocab)
    times: dict[str, list[float]] = {k: [] for k in systems}
    results = {}
    for r in range(rounds + 1):
        for k in rotated(list(systems), r):
            x = logits.clone()
            t = timed(lambda: systems[k](x, bitmask))
            results[k] = x
            if r:  # round 0 warms up
                times[k].append(t)
    out = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
    return {**out, "rows": bitmask.shape[0], "same_result": all(torch.equal(results["engine_apply_bitmask"], x)
                                                                 for x in results.values())}


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("xgrammar", "llguidance", "outlines_core"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def choose(libraries: dict) -> tuple[str | None, str]:
    """The lowest summed JSON mask cost among libraries that handled every case and enforce every common keyword."""
    complete = {name: lib for name, lib in libraries.items()
                if "cases" in lib and all("error" not in c for c in lib["cases"].values())}
    cost = {name: sum(lib["cases"][c]["mask_us_per_seq"] for c in JSON_CASES) for name, lib in complete.items()}
    supported = {k: v for k, v in cost.items()
                 if not libraries[k]["ignores_common"] and not libraries[k]["refuses_common"]}
    if not supported:
        return None, "no library handled every case and enforced every common keyword"
    best = min(supported, key=supported.get)
    ranked = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cost.items(), key=lambda kv: kv[1]))
    left_out = "; ".join(f"{k} leaves unenforced {', '.join(libraries[k]['ignores_common'])}"
                         for k in cost if libraries[k]["ignores_common"])
    return best, (f"mask cost per sequence summed over the 3 JSON schemas, us: {ranked}. Lowest among the libraries "
                  f"that enforce every common keyword" + (f" ({left_out})" if left_out else ""))


def prepare(names: list[str], tokenizer, args) -> tuple[dict, dict]:
    """Per library: its wrapper (libs) and its figures so far (compile times, conformance, the cases ready to run)."""
    libs, libraries = {}, {}
    cases = [c for c in CASES if c[0] in args.cases]
    for name in names:
        try:
            t0 = time.perf_counter()
            libs[name] = LIBRARIES[name](tokenizer, len(tokenizer), args.threads)
            setup_s = time.perf_counter() - t0
        except ImportError as e:
            libraries[name] = {"error": f"not installed: {e}"}
            continue
        figures, ready = measure_library(libs[name], tokenizer, cases, args.compiles)
        common = conformance(libs[name], tokenizer, COMMON)
        libraries[name] = {"setup_s": setup_s, "cases": figures, "ready": ready,
                           "ignores_common": [k for k, v in common.items() if v.startswith("ignored")],
                           "refuses_common": [k for k, v in common.items() if v.startswith("refused")],
                           "common_keywords": common, "extra_keywords": conformance(libs[name], tokenizer, EXTRA)}
    return libs, libraries


def time_masks(libs: dict, libraries: dict, n: int, rounds: int, vocab: int) -> None:
    """Lockstep replays, every library once per round in rotated order; summaries into each library's cases."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(rounds):
        for name in rotated(list(libs), r):
            for case, (compiled, ids) in libraries[name]["ready"].items():
                runs.setdefault((name, case), []).append(replay(libs[name], compiled, ids, n, vocab))
    for (name, case), results in runs.items():
        libraries[name]["cases"][case].update(summarize(results, n))
    for lib in libraries.values():
        lib.pop("ready", None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="sequences (matchers) per mask step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--libraries", nargs="+", default=list(LIBRARIES))
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in CASES])
    args = parse_bench_args(ap, argv, "structured", QUICK)
    from transformers import AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))
    vocab = len(tokenizer)
    libs, libraries = prepare(args.libraries, tokenizer, args)
    time_masks(libs, libraries, args.n, args.rounds, vocab)
    chosen, why = choose(libraries)
    load = os.getloadavg()[0]
    result = {"benchmark": "structured", "quick": args.quick, "vocab": vocab, "n": args.n, "rounds": args.rounds,
              "compiles": args.compiles, "threads": args.threads, "versions": library_versions(),
              "libraries": libraries, "chosen": chosen, "why": why,
              "apply": apply_figures(mid_json_bitmask(args.n, vocab, tokenizer), vocab, args.rounds),
              "load_avg_1m": load, "contended": load > args.threads + 1}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
