"""Our packed cross-encoder against transformers' AutoModelForSequenceClassification on the same weights."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertConfig,
                          BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification,
                          RobertaTokenizer, XLMRobertaConfig, XLMRobertaForSequenceClassification,
                          XLMRobertaTokenizer)
from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

from engine.embed import embedded_embedder_dir
from engine.models.bert import EncoderArgs, packed_positions
from engine.config import RerankParams
from engine.models.encoder_loader import CrossEncoder, score_activation
from engine.rerank.cross_encoder import CrossEncoderScorer
from tests.models_built import copy_minilm_tokenizer, save_model_dir

ATOL = 1e-4
QUERY = "how do lighthouses warn ships at night"
WORDS = ("light beam lens keeper ship rock coast fog horn night signal tower lamp sea storm harbor "
         "stone island wave flash rotate mirror oil electric automated").split()


def _docs(n: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))) for _ in range(n)]


def _seeded(seed: int, build):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


def _byte_level_tokenizer() -> RobertaTokenizer:
    """A RoBERTa tokenizer built offline: byte-level alphabet, no merges, so one token per character."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + sorted(ByteLevel.alphabet()) + ["<mask>"]
    return RobertaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def _unigram_tokenizer() -> XLMRobertaTokenizer:
    """An XLM-R (sentencepiece unigram) tokenizer built offline from letters and a few whole words."""
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(c, -2.0 - i / 100) for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz")]
    pieces += [("▁" + w, -1.0) for w in WORDS[:10]] + [("<mask>", 0.0)]
    return XLMRobertaTokenizer(vocab=pieces)


def _tiny_bert(directory: Path) -> Path:
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, hidden_act="gelu_new", initializer_range=0.2, num_labels=2)
    model = _seeded(1, lambda: BertForSequenceClassification(cfg))
    return save_model_dir(model, directory, copy_minilm_tokenizer)


def _tiny_roberta(directory: Path) -> Path:
    cfg = RobertaConfig(vocab_size=261, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, hidden_act="gelu", initializer_range=0.2, num_labels=1,
                        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2)
    model = _seeded(2, lambda: RobertaForSequenceClassification(cfg))
    return save_model_dir(model, directory, _byte_level_tokenizer().save_pretrained)


def _tiny_xlmr(directory: Path) -> Path:
    cfg = XLMRobertaConfig(vocab_size=41, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=128, hidden_act="relu", initializer_range=0.2, num_labels=1,
                           max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2)
    model = _seeded(3, lambda: XLMRobertaForSequenceClassification(cfg))
    return save_model_dir(model, directory, _unigram_tokenizer().save_pretrained,
                 {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}})


TINY = {"bert": _tiny_bert, "roberta": _tiny_roberta, "xlm-roberta": _tiny_xlmr}


@pytest.fixture(scope="module", params=list(TINY))
def tiny_dir(request, tmp_path_factory) -> Path:
    return TINY[request.param](tmp_path_factory.mktemp(f"tiny_{request.param}"))


def _hf(directory: Path):
    return AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_logits(hf, pairs) -> torch.Tensor:
    """The reference: each pair alone, unpadded."""
    return torch.cat([hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits for ids, types in pairs])


def _tokenize(ce: CrossEncoder, query: str, docs: list[str], max_length: int | None = None, truncate: str = "end"):
    """(input_ids, token_type_ids) per document, as the cross-encoder rerank mode builds them."""
    pairs, _ = CrossEncoderScorer(ce).pairs(query, docs, RerankParams(truncate=truncate), max_length or ce.max_length)
    return [(p.token_ids, p.token_type_ids) for p in pairs]


def _assert_matches_hf(ce: CrossEncoder, hf, pairs) -> torch.Tensor:
    ours = ce.logits(pairs)
    ref = _hf_logits(hf, pairs)
    assert ours.shape == ref.shape == (len(pairs), ce.num_labels)
    assert (ours - ref).abs().max().item() <= ATOL
    return ref


def _assert_tokenized_like_hf(ce: CrossEncoder, tokenizer, query: str, docs: list[str], pairs) -> None:
    for doc, (ids, types) in zip(docs, pairs):
        # tokenizer(q, "") drops the falsy pair; the batched call (what sentence-transformers uses) keeps it.
        ref = tokenizer(query, doc) if doc else {k: v[0] for k, v in tokenizer([query], [doc]).items()}
        assert ids == ref["input_ids"]
        assert types == ref.get("token_type_ids", [0] * len(ids))


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> CrossEncoder:
    return CrossEncoder.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def minilm_hf(minilm_dir):
    return _hf(minilm_dir)


def test_minilm_packed_batch_matches_transformers(minilm, minilm_hf, minilm_dir):
    docs = ["", "Fog horns.", " ".join(WORDS) * 10] + _docs(4, 60, seed=0)
    pairs = _tokenize(minilm, QUERY, docs)
    _assert_tokenized_like_hf(minilm, AutoTokenizer.from_pretrained(minilm_dir), QUERY, docs, pairs)
    lengths = [len(ids) for ids, _ in pairs]
    assert min(lengths) < 16 and max(lengths) >= 250 and len(set(lengths)) >= 6
    ref = _assert_matches_hf(minilm, minilm_hf, pairs)
    # num_labels == 1 and no activation in config.json: sigmoid, as sentence-transformers' CrossEncoder
    assert minilm.score(pairs) == pytest.approx(torch.sigmoid(ref[:, 0]).tolist(), abs=ATOL)


def test_tiny_models_packed_batch_match_transformers(tiny_dir):
    ce, hf = CrossEncoder.from_pretrained(tiny_dir), _hf(tiny_dir)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    # Character-level tokenizers for the RoBERTa pair, word-piece for BERT: aim for roughly 3..300 tokens.
    char_level = cfg["model_type"] != "bert"
    docs = ["", "fog"] + (_docs(8, 50, seed=1) if char_level else [" ".join(WORDS) * 11] + _docs(7, 150, seed=1))
    query = "" if cfg["model_type"] == "bert" else "fog"
    pairs = _tokenize(ce, query, docs)
    _assert_tokenized_like_hf(ce, AutoTokenizer.from_pretrained(tiny_dir), query, docs, pairs)
    lengths = [len(ids) for ids, _ in pairs]
    assert min(lengths) <= 8 and 200 <= max(lengths) <= 320
    ref = _assert_matches_hf(ce, hf, pairs)
    if cfg["model_type"] == "bert":  # two labels: probability of label 1
        expected = torch.softmax(ref, dim=-1)[:, 1]
    elif cfg["model_type"] == "xlm-roberta":  # Identity named in config.json: the raw logit
        expected = ref[:, 0]
    else:
        expected = torch.sigmoid(ref[:, 0])
    scores = ce.score(pairs)
    assert scores == pytest.approx(expected.tolist(), abs=ATOL)
    for i in (0, 2, len(pairs) - 1):
        assert abs(ce.score([pairs[i]])[0] - scores[i]) <= 1e-5


def test_score_does_not_depend_on_batch_composition(minilm):
    docs = _docs(64, 12, seed=2)
    docs[17] = " ".join(WORDS) * 6
    pairs = _tokenize(minilm, QUERY, docs)
    packed = minilm.score(pairs)
    for i in (0, 17, 63):
        alone = minilm.score([pairs[i]])
        assert abs(alone[0] - packed[i]) <= 1e-5
    assert minilm.score(pairs[10:20]) == pytest.approx(packed[10:20], abs=1e-5)


def test_truncate_end_matches_hf_only_second(minilm, minilm_hf, minilm_dir):
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    long_doc = " ".join(WORDS) * 30
    assert minilm.max_length == 512
    for max_length in (None, 40):
        limit = max_length or minilm.max_length
        pairs = _tokenize(minilm, QUERY, ["short doc", long_doc], max_length=max_length, truncate="end")
        for doc, (ids, types) in zip(["short doc", long_doc], pairs):
            ref = tokenizer(QUERY, doc, truncation="only_second", max_length=limit)
            assert (ids, types) == (ref["input_ids"], ref["token_type_ids"])
        assert len(pairs[1][0]) == limit
    _assert_matches_hf(minilm, minilm_hf, pairs)


def test_truncate_none_over_max_length_raises_naming_the_pair(minilm):
    with pytest.raises(ValueError, match=r"documents\[2\] .*over the rerank pair limit of 512"):
        _tokenize(minilm, QUERY, ["a", "b", " ".join(WORDS) * 30], truncate="none")
    with pytest.raises(ValueError, match=r"documents\[1\] "):
        _tokenize(minilm, QUERY, ["a", " ".join(WORDS)], max_length=20, truncate="none")
    assert len(_tokenize(minilm, QUERY, ["a", "b"], truncate="none")) == 2


def test_query_longer_than_max_length_is_rejected(minilm):
    with pytest.raises(ValueError, match="query is"):
        _tokenize(minilm, " ".join(WORDS), ["doc"], max_length=16, truncate="end")


def test_bare_encoder_with_head_in_separate_file(minilm_dir, minilm_hf, tmp_path):
    """BertModel keys without the `bert.` prefix (as the MiniLM package ships them), head in its own file."""
    src = embedded_embedder_dir()
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    head = {k: v for k, v in load_file(minilm_dir / "model.safetensors").items() if k.startswith("classifier.")}
    save_file(head, str(tmp_path / "classifier.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    copy_minilm_tokenizer(tmp_path)
    ce = CrossEncoder.from_pretrained(tmp_path)
    _assert_matches_hf(ce, minilm_hf, _tokenize(ce, QUERY, ["fog horn", " ".join(WORDS)]))


def test_missing_head_is_reported(tmp_path):
    src = embedded_embedder_dir()
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="is a bare bert encoder .* without a classification head") as err:
        CrossEncoder.from_pretrained(tmp_path)
    assert "pass a cross-encoder" in str(err.value) and "\n" not in str(err.value)  # one line that says what to do


def test_roberta_positions_match_hf_including_inner_pad_ids():
    args = EncoderArgs.from_hf_config({"model_type": "roberta", "vocab_size": 10, "hidden_size": 8,
                                       "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "pad_token_id": 1}, num_labels=1)
    seqs = [[0, 5, 2], [0, 1, 7, 1, 8, 2], [0, 2, 2, 9, 9, 9, 9, 2]]
    ids = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0, 3, 9, 17], dtype=torch.int32)
    ours = packed_positions(ids, cu, args).split([len(s) for s in seqs])
    for s, mine in zip(seqs, ours):
        ref = RobertaEmbeddings.create_position_ids_from_input_ids(torch.tensor([s]), padding_idx=1)[0]
        assert mine.tolist() == ref.tolist()
    assert args.max_tokens == 512 - 2


def test_score_activation_from_config():
    logits = torch.tensor([[0.5], [-2.0]])
    assert score_activation({}, 1)(logits).tolist() == pytest.approx(torch.sigmoid(logits[:, 0]).tolist())
    old = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}
    assert score_activation(old, 1)(logits).tolist() == pytest.approx(torch.tanh(logits[:, 0]).tolist())
    identity = {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    assert score_activation(identity, 1)(logits).tolist() == [0.5, -2.0]
    with pytest.raises(ValueError, match="unsupported cross-encoder activation"):
        score_activation({"sentence_transformers": {"activation_fn": "my_pkg.Custom"}}, 1)
    with pytest.raises(ValueError, match="3 labels"):
        score_activation({}, 3)


def test_empty_and_malformed_pairs(minilm):
    assert minilm.score([]) == []
    assert _tokenize(minilm, QUERY, []) == []
    with pytest.raises(ValueError, match="pair 0"):
        minilm.score([([], [])])
    with pytest.raises(ValueError, match="pair 1"):
        minilm.score([([101, 102], [0, 0]), ([101] * 600, [0] * 600)])
    with pytest.raises(ValueError, match="truncate must be"):
        _tokenize(minilm, QUERY, ["a"], truncate="start")
