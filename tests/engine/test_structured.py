"""Structured output (engine/structured.py): the bitmask against llguidance's own token-by-token verdicts and the
tokenizer's vocabulary, apply_bitmask against a bit-by-bit reference, ValueErrors that name the problem, the
compile cache, and the acceptance test of #20: 50 seeded sampled generations per schema that all validate with
jsonschema, a regex case and a choice case on the embedded model."""
import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from engine.config import SamplingParams, StructuredOutputsParams
from engine.structured import (CompiledGrammar, GrammarCompiler, GrammarMatcher, allocate_bitmask, apply_bitmask,
                               choice_regex)

# The three schemas (nested object, array of enums, string pattern), a regex and a choice list: the cases
# the mask benchmark (bench/structured.py) times too; the tests keep their own copy, as tests import nothing of bench.
NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ENUM_ARRAY = {"type": "array", "minItems": 1, "maxItems": 4,
              "items": {"type": "string", "enum": ["red", "green", "blue"]}}
PATTERN = {"type": "object", "additionalProperties": False, "required": ["sku"],
           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def vocab(tokenizer) -> int:
    return len(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab)


def allowed(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    """Token ids whose bit is set, read bit by bit in Python (the layout: bit t % 32 of word t // 32)."""
    return [32 * w + j for w, word in enumerate(bitmask[row].tolist()) for j in range(32) if (word >> j) & 1]


def fill(matcher, vocab: int) -> list[int]:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return allowed(bitmask)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- the bitmask against references ------------------------------------------------------------------------

@pytest.mark.parametrize("params, text", [
    (StructuredOutputsParams(json=NESTED), ""),
    (StructuredOutputsParams(json=NESTED), '{"name": "Ad'),  # inside a bounded string
    (StructuredOutputsParams(json=NESTED), '{"name": "Ada", "address": {"city": "Rome", "zip": "0012'),
    (StructuredOutputsParams(json=ENUM_ARRAY), '["red", '),
    (StructuredOutputsParams(regex=DATE), "2024-1"),
    (StructuredOutputsParams(regex="a+"), "aa"),  # a state where the grammar may end or go on
    (StructuredOutputsParams(choice=CHOICES), "ne"),
])
def test_bitmask_is_the_library_mask_and_every_allowed_token_is_admissible(tokenizer, compiler, vocab, params, text):
    """Reference: an llguidance matcher built here from the grammar text, not through engine/structured: its own
    mask, and its token-by-token verdict (validate_tokens), a separate code path. The mask may allow fewer tokens
    than are admissible: where the next bytes are forced llguidance keeps only the canonical token ('{"', not '{')."""
    compiled = compiler.compile(params)
    ours = compiler.matcher(compiled)
    reference = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), compiled.grammar,
                                     log_level=0)
    for t in enc(tokenizer, text):
        assert ours.accept(t) and reference.consume_token(t)
    library_mask = torch.frombuffer(bytearray(reference.compute_bitmask()), dtype=torch.int32).unsqueeze(0)
    got = fill(ours, vocab)
    assert got == allowed(library_mask) and got
    assert set(got) <= {t for t in range(vocab) if reference.validate_tokens([t]) == 1}
    # EOS is allowed exactly when the text so far is a complete value of the language.
    assert (tokenizer.eos_token_id in got) == reference.is_accepting()


def test_choice_allows_first_the_tokens_that_begin_a_choice(tokenizer, compiler, vocab):
    """Reference: the vocabulary itself, a token allowed iff its text is a non-empty prefix of some choice."""
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=CHOICES)))
    texts = {t: tokenizer.decode([t]) for t in range(vocab) if t not in tokenizer.all_special_ids}
    expected = sorted(t for t, s in texts.items() if s and any(c.startswith(s) for c in CHOICES))
    assert fill(matcher, vocab) == expected


def test_eos_is_allowed_only_where_the_grammar_can_end(tokenizer, compiler, vocab):
    eos = tokenizer.eos_token_id
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="[0-9]{2,3}")))
    steps = []
    for t in enc(tokenizer, "1") + enc(tokenizer, "2") + enc(tokenizer, "3"):
        steps.append(eos in fill(matcher, vocab))
        assert matcher.accept(t)
    assert steps == [False, False, True]  # before "1", before "2": too short; before "3": "12" is complete
    assert matcher.is_terminated()  # "123": three digits, nothing may follow
    assert fill(matcher, vocab) == [eos]  # a finished grammar can only stop
    assert matcher.accept(eos) and not matcher.accept(enc(tokenizer, "4")[0])


def test_a_stop_tokens_text_as_a_choice_is_never_offered_the_stop_token(tokenizer, compiler, vocab):
    """llguidance's mask lets the stop token through where its text (`<|im_end|>`) is what the grammar asks for, then
    refuses to consume it (found by the gRPC fuzzer: INTERNAL "the grammar rejected token 2"). A grammar with
    nothing else to offer is refused at compile; with other choices the stop token is left out of the mask."""
    eos = tokenizer.eos_token_id
    stop_text = tokenizer.convert_ids_to_tokens([eos])[0]
    with pytest.raises(ValueError, match="structured_outputs.choice cannot be served: no token can continue it"):
        compiler.compile(StructuredOutputsParams(choice=[stop_text, stop_text]))
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=["yes", stop_text])))
    got = fill(matcher, vocab)
    assert eos not in got and got and all(matcher.compiled.template.validate_tokens([t]) == 1 for t in got)


def test_a_matcher_past_the_parser_limits_fails_instead_of_completing(tokenizer, compiler, vocab):
    """llguidance bounds the work of one mask (its parser limits; tiny here): past them the matcher fails, its mask
    allows only the stop tokens, and the stop token is refused, so the engine fails the request."""
    compiled = compiler.compile(StructuredOutputsParams(regex="[a-z]{1,40}"))
    template = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), compiled.grammar,
                                    log_level=0, limits=llguidance.LLParserLimits(max_lexer_states=2))
    matcher = GrammarMatcher(CompiledGrammar(compiled.kind, compiled.key, compiled.grammar, template),
                             compiler.stop_token_ids)
    assert fill(matcher, vocab) == [tokenizer.eos_token_id]
    assert not matcher.accept(tokenizer.eos_token_id) and not matcher.is_terminated()
    assert fill(compiler.matcher(compiled), vocab) != [tokenizer.eos_token_id]  # the default limits are far off


def test_choice_strings_are_literal_not_regex(tokenizer, compiler):
    tricky = ['a.c', '(x)|[y]', 'q"u\\o', 'x-y~z#&', 'née', 'a+b*']
    assert re.fullmatch(choice_regex(tricky), "abc") is None
    compiled = compiler.compile(StructuredOutputsParams(choice=tricky))

    def takes(text: str) -> bool:
        m = compiler.matcher(compiled)
        return all(m.accept(t) for t in enc(tokenizer, text)) and (m.is_terminated()
                                                                  or m.accept(tokenizer.eos_token_id))
    assert all(takes(text) for text in tricky)
    assert not any(takes(text) for text in ["abc", "x", "(x)", "aab", "q\"u", "nee"])


def test_model_vocab_larger_than_the_tokenizer(tokenizer, vocab):
    """Ids past the tokenizer (embedding padding) are never allowed; a row without a grammar is untouched."""
    model_vocab = vocab + 70
    compiler = GrammarCompiler(tokenizer, model_vocab)
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=ENUM_ARRAY)))
    bitmask = allocate_bitmask(2, model_vocab)
    assert bitmask.shape == (2, (model_vocab + 31) // 32)
    matcher.fill_bitmask(bitmask, 0)
    assert max(allowed(bitmask)) < vocab
    logits = torch.randn(2, model_vocab)
    before = logits.clone()
    apply_bitmask(logits, bitmask)
    assert torch.isinf(logits[0, vocab:]).all()
    assert torch.equal(logits[1], before[1])


# ---- apply_bitmask against a bit-by-bit reference ----------------------------------------------------------------

def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf at every column whose bit is 0 or that lies past the bitmask, for rows that mask anything."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        words = bitmask[r].tolist()
        if all(w == -1 for w in words):
            continue
        for t in range(logits.shape[1]):
            if t >= 32 * len(words) or not (words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 100, 130])  # a whole number of words, a partial last word, wider logits
def test_apply_bitmask_matches_a_bit_by_bit_reference(dtype, width):
    g = torch.Generator().manual_seed(width)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32, generator=g)  # covers 128 tokens
    bitmask[2] = -1  # a row without a grammar
    bitmask[3] = 0
    bitmask[3, 1] = -2**31  # only token 63 (bit 31 is the sign bit)
    logits = torch.randn(5, width, generator=g).to(dtype)
    logits[4, 7] = float("inf")  # min(logit, limit) must still mask it when its bit is 0
    bitmask[4, 0] &= ~(1 << 7)
    expected = reference_apply(logits, bitmask)
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert allowed(bitmask, 3) == [63]


def test_apply_bitmask_leaves_an_unconstrained_batch_alone():
    logits = torch.randn(3, 64)
    before = logits.clone()
    apply_bitmask(logits, allocate_bitmask(3, 64))
    assert torch.equal(logits, before)


# ---- errors name the problem ---------------------------------------------------------------------------------------

# (spec, what the message names). The first group is invalid per JSON Schema's own meta-schema (checked below with
# jsonschema, the reference), the second valid but unsatisfiable or unsupported.
META_INVALID = [({"type": "nonsense"}, "nonsense"), ({"type": 5}, "type"), ({"anyOf": []}, "anyOf"),
                ({"type": "string", "pattern": "[abc"}, "unclosed character class"),
                ({"properties": 3}, "properties")]
UNUSABLE = [({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"), ({"not": {"type": "string"}}, "not"),
            ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
            ({"type": "array", "minItems": 1, "items": {"enum": []}}, "unsatisfiable")]


@pytest.mark.parametrize("schema, named", META_INVALID + UNUSABLE)
def test_an_unusable_schema_is_a_value_error_naming_it(compiler, schema, named):
    with pytest.raises(ValueError, match=r"structured_outputs\.json") as err:
        compiler.compile(StructuredOutputsParams(json=schema))
    assert named.lower() in str(err.value).lower()
    with pytest.raises(ValueError):  # also as JSON text
        compiler.compile(StructuredOutputsParams(json=json.dumps(schema)))


@pytest.mark.parametrize("schema, _", META_INVALID)
def test_the_invalid_schemas_are_invalid_for_jsonschema_too(schema, _):
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("text, named", [("{not json", "not valid JSON"), ("[1, 2]", "JSON schema object"),
                                         ('"string"', "JSON schema object")])
def test_schema_text_that_is_not_a_json_object(compiler, text, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        compiler.compile(StructuredOutputsParams(json=text))


@pytest.mark.parametrize("regex, named", [("(ab", "unclosed group"), ("a{3,1}", "repetition"),
                                          ("[z-a]", "class range"), ("(?=a)b", "look-around")])
def test_an_invalid_regex_is_a_value_error_naming_it(compiler, regex, named):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex") as err:
        compiler.compile(StructuredOutputsParams(regex=regex))
    assert named in str(err.value)


@pytest.mark.parametrize("choice", [[], ["a", ""], ["a", 3], "abc"])
def test_a_bad_choice_list_is_a_value_error_naming_it(choice):
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=choice)


# ---- the compile cache ------------------------------------------------------------------------------------------

def test_the_cache_returns_the_same_compiled_grammar(compiler):
    a = compiler.compile(StructuredOutputsParams(json=NESTED))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(NESTED, indent=2))) is a
    date = compiler.compile(StructuredOutputsParams(regex=DATE))
    assert compiler.compile(StructuredOutputsParams(regex=DATE)) is date
    c = compiler.compile(StructuredOutputsParams(choice=["x", "y"]))
    assert compiler.compile(StructuredOutputsParams(choice=["x", "y"])) is c
    assert compiler.compile(StructuredOutputsParams(choice=["y", "x"])) is not c
    # Property order is part of the language (the grammar emits properties in order): another order, another grammar.
    reordered = {**NESTED, "properties": dict(reversed(list(NESTED["properties"].items())))}
    assert compiler.compile(StructuredOutputsParams(json=reordered)) is not a


def test_the_cache_is_a_bounded_lru(tokenizer, vocab):
    compiler = GrammarCompiler(tokenizer, vocab, cache_size=2)
    p = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    a, b = compiler.compile(p[0]), compiler.compile(p[1])
    assert compiler.compile(p[0]) is a  # a is now the most recent
    compiler.compile(p[2])  # evicts b
    assert compiler.compile(p[0]) is a
    assert compiler.compile(p[1]) is not b


def test_matchers_of_one_grammar_are_independent(tokenizer, compiler, vocab):
    compiled = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    m1, m2 = compiler.matcher(compiled), compiler.matcher(compiled)
    for t in enc(tokenizer, "negative"):
        assert m1.accept(t)
    assert m1.is_terminated() and not m2.is_terminated()
    assert fill(m2, vocab) == fill(compiler.matcher(compiled), vocab)


# ---- acceptance (#20): 50 seeded sampled generations per case, through the engine -------------------------------

SEEDS = range(50)


def generate(llm, structured: StructuredOutputsParams, prompt: str) -> list:
    """50 completions of one chat prompt, temperature 1.0, seeds 0..49, in one LLM.chat call."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured_outputs=structured) for s in SEEDS]
    outs = llm.chat([[{"role": "user", "content": prompt}]] * len(params), params)
    assert [o.finish_reason for o in outs] == ["stop"] * len(params)  # every one ended by its grammar or EOS
    return [o.text for o in outs]


@pytest.mark.parametrize("schema, prompt", [
    (NESTED, "Make up a person and give their name and address (city and zip code) as JSON."),
    (ENUM_ARRAY, "Which colours do you like? Answer with a JSON array."),
    (PATTERN, "Invent a product code for a shoe and give it as JSON."),
], ids=["nested_object", "array_of_enums", "string_pattern"])
def test_sampled_generations_validate_against_the_schema(llm, schema, prompt):
    texts = generate(llm, StructuredOutputsParams(json=schema), prompt)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # the seeds drew different completions: the mask constrains, it does not decide


def test_sampled_generations_match_the_regex(llm):
    texts = generate(llm, StructuredOutputsParams(regex=DATE), "When was the first moon landing? Give the date.")
    assert all(re.fullmatch(DATE, t) for t in texts), texts


def test_sampled_generations_are_one_of_the_choices(llm):
    texts = generate(llm, StructuredOutputsParams(choice=CHOICES),
                     "Is this review positive, negative or neutral? 'The battery died after a day.'")
    assert set(texts) <= set(CHOICES), texts


def test_an_invalid_schema_is_refused_at_submission(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": 3}))
    with pytest.raises(ValueError, match="properties must be an object"):
        llm.engine.add_request("bad-schema", "Hello", bad)
    assert "bad-schema" not in llm.engine.request_ids and not llm.engine.has_unfinished()
