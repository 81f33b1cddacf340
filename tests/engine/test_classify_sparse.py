"""The pooling tasks past embeddings (EmbedParams.task): a sequence classifier's probabilities and a SPLADE model's
sparse vectors match transformers on tiny random models built here (float32), their rows ride the same steps as a
decode, and a server without the model says which flag loads it."""
from __future__ import annotations

import json

import pytest
import torch

from tests.models_built import copy_minilm_tokenizer
from engine import LLM, EmbedParams, EngineConfig, SamplingParams
from engine.config import PoolingTask
from engine.errors import NotLoaded
from engine.outputs import EmbedOutput

TEXTS = ["A lighthouse keeper trims the wick every night.", "Fog horns sound when the light cannot be seen.",
         "Bananas.", "Ships read the light's pattern of flashes on their charts to know where they are."]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
CLASSIFY = EmbedParams(task=PoolingTask.CLASSIFY)
SPARSE = EmbedParams(task=PoolingTask.SPARSE)


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128, **kw)


def tiny_classifier(directory, multi_label: bool = False, seed: int = 5, **config):
    """A tiny random BertForSequenceClassification with three labels, saved with the MiniLM tokenizer (`config`: more
    BertConfig fields)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = _bert_config(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
                       problem_type="multi_label_classification" if multi_label else "single_label_classification",
                       **config)
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(directory)
    copy_minilm_tokenizer(directory)
    return model


def tiny_splade(directory, seed: int = 6):
    """A tiny random BertForMaskedLM (SPLADE's architecture), its head's bias shifted so that some weights are zero
    and some are not."""
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    model = BertForMaskedLM(_bert_config()).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    copy_minilm_tokenizer(directory)
    return model


def splade_reference(model, tokenizer, texts: list[str]) -> list[dict[int, float]]:
    """max over tokens (attention-masked) of log(1 + relu(logits)), from AutoModelForMaskedLM, batched with padding."""
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**enc).logits
    weights = (torch.log1p(torch.relu(logits)) * enc.attention_mask[..., None]).amax(1)
    return [{i: weights[r, i].item() for i in weights[r].nonzero().flatten().tolist()} for r in range(len(texts))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("pooling")
    dirs = {name: base / name for name in ("softmax", "multi", "splade")}
    for d in dirs.values():
        d.mkdir()
    refs = {"softmax": tiny_classifier(dirs["softmax"]), "multi": tiny_classifier(dirs["multi"], multi_label=True),
            "splade": tiny_splade(dirs["splade"])}
    return dirs, refs


@pytest.fixture(scope="module")
def llm(models) -> LLM:
    dirs, _ = models
    # num_kv_blocks: a small KV pool for short prompts; the default 1 GiB is zero-filled at every build (~0.6 s of a core)
    return LLM(EngineConfig(num_kv_blocks=64, classifier=str(dirs["softmax"]), sparse_embedder=str(dirs["splade"]),
                            max_num_batched_tokens=256))


def _tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def test_classifier_probabilities_match_transformers_softmax(llm: LLM, models) -> None:
    dirs, refs = models
    enc = _tokenizer(dirs["softmax"])(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = refs["softmax"](**enc).logits
    got = torch.tensor(llm.embed(TEXTS, CLASSIFY))
    assert (got - logits.softmax(-1)).abs().max().item() <= 1e-5
    raw = torch.tensor(llm.embed(TEXTS, EmbedParams(task=PoolingTask.CLASSIFY, raw_scores=True)))
    assert (raw - logits).abs().max().item() <= 1e-5
    assert llm.engine.model_info()["classifier_labels"] == ["negative", "neutral", "positive"]


PAIRS = [("A lighthouse keeper trims the wick every night.", "Someone looks after a light."),
         ("Bananas.", "Fog horns sound when the light cannot be seen."),
         ("Ships read the light's pattern of flashes.", "Sailors know where they are from it.")]


@pytest.fixture(scope="module")
def nli(tmp_path_factory):
    """A pair classifier (an NLI model's shape) whose weights are large enough that a pair's segment ids move its
    probabilities by far more than the bound: the LLM serving it and the transformers model."""
    directory = tmp_path_factory.mktemp("nli")
    ref = tiny_classifier(directory, seed=7, initializer_range=0.5)
    return LLM(EngineConfig(classifier=str(directory), embedder=None, max_num_batched_tokens=256,
                            num_kv_blocks=64)), ref, directory


def test_text_pairs_are_classified_as_transformers_encodes_a_pair(nli) -> None:
    """An NLI / cross-encoder style input: (text, text_pair) as `tokenizer(text, text_pair)` encodes it, segment ids
    included; singles and pairs mixed in one request, each as transformers gives it alone."""
    llm, ref, directory = nli
    tok = _tokenizer(directory)
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    assert enc.token_type_ids.any()  # the second text is segment 1
    with torch.inference_mode():
        logits = ref(**enc).logits
        untyped = ref(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits.softmax(-1)
        single = ref(**tok(TEXTS[:1], return_tensors="pt")).logits
    want = logits.softmax(-1)
    assert (want - untyped).abs().max().item() > 1e-2  # segment ids move the result: the checks below can fail
    mixed = [PAIRS[0], TEXTS[0], list(PAIRS[1]), PAIRS[2]]
    got = torch.tensor(llm.embed(mixed, CLASSIFY))
    assert (got[[0, 2, 3]] - want).abs().max().item() <= 1e-5
    assert (got[1] - single[0].softmax(-1)).abs().max().item() <= 1e-5
    raw = torch.tensor(llm.embed(mixed, EmbedParams(task=PoolingTask.CLASSIFY, raw_scores=True)))
    assert (raw[[0, 2, 3]] - logits).abs().max().item() <= 1e-4


def test_a_long_pair_is_cut_as_the_tokenizer_cuts_it_or_refused(nli, llm: LLM) -> None:
    nli_llm, ref, directory = nli
    long_pair = ("lighthouse " * 100, "the keeper trims the wick " * 8)
    enc = _tokenizer(directory)(*long_pair, truncation="longest_first", max_length=128, return_tensors="pt")
    assert enc.input_ids.shape[1] == 128 and enc.token_type_ids.any()
    with torch.inference_mode():
        want = ref(**enc).logits.softmax(-1)[0]
    got = torch.tensor(nli_llm.embed([long_pair], EmbedParams(task=PoolingTask.CLASSIFY, truncate=True))[0])
    assert (got - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="text pair"):
        nli_llm.engine.prepare_embed("x", [long_pair], EmbedParams(task=PoolingTask.CLASSIFY, truncate=False))
    with pytest.raises(ValueError, match="classified only"):
        llm.engine.prepare_embed("x", [PAIRS[0]], SPARSE)
    with pytest.raises(ValueError, match="empty"):
        llm.engine.prepare_embed("x", [("a", "")], CLASSIFY)


def test_a_multi_label_classifier_gives_sigmoid_per_label(models) -> None:
    from engine.embed import Embedder
    from engine.embed.job import EmbedJob  # noqa: F401  (the job the rows belong to)

    dirs, refs = models
    clf = Embedder.load(str(dirs["multi"]), task=PoolingTask.CLASSIFY)
    assert clf.multi_label and clf.labels == ("negative", "neutral", "positive")
    rows = [r.token_ids for r in clf.rows(TEXTS, None, CLASSIFY)]
    enc = _tokenizer(dirs["multi"])(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        ref = torch.sigmoid(refs["multi"](**enc).logits)
    got = torch.tensor([clf.finish_row(v, CLASSIFY) for v in clf.run(rows, [False] * len(rows))])
    assert (got - ref).abs().max().item() <= 1e-5


def test_splade_sparse_vectors_match_the_masked_lm_formula(llm: LLM, models) -> None:
    dirs, refs = models
    ref = splade_reference(refs["splade"], _tokenizer(dirs["splade"]), TEXTS)
    got = llm.embed(TEXTS, SPARSE)
    for g, r in zip(got, ref):
        assert 0 < len(r) < 30522  # the shifted bias leaves some ids at zero and some not
        assert [i for i, _ in g] == sorted(r)
        assert max(abs(v - r[i]) for i, v in g) <= 1e-5


def test_classify_and_sparse_rows_ride_the_same_steps_as_a_decode(llm: LLM) -> None:
    engine = llm.engine
    records = []
    engine.add_observer(records.append)
    try:
        engine.add_request("g", "Hello there", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        engine.step()  # its prompt; every later step decodes it
        engine.add_embed("c", TEXTS, CLASSIFY)
        engine.add_embed("s", TEXTS, SPARSE)
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        engine.remove_observer(records.append)
    assert isinstance(finished["c"], EmbedOutput) and len(finished["c"].embeddings) == len(TEXTS)
    assert isinstance(finished["s"], EmbedOutput) and len(finished["s"].embeddings) == len(TEXTS)
    assert sum(r.embed_rows_done for r in records) == 2 * len(TEXTS)
    assert any(r.embed_rows and r.decode_tokens for r in records)
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_bad_inputs_and_missing_models_name_the_field_or_flag(llm: LLM) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        llm.engine.prepare_embed("x", [], CLASSIFY)
    too_many = ["a"] * (llm.engine.config.max_embed_inputs + 1)
    with pytest.raises(ValueError, match="max-embed-inputs"):
        llm.engine.prepare_embed("x", too_many, SPARSE)
    with pytest.raises(ValueError, match="apply to embeddings"):
        EmbedParams(task=PoolingTask.SPARSE, all_tokens=True)
    bare = LLM(EngineConfig(max_num_batched_tokens=256, num_kv_blocks=64))
    with pytest.raises(NotLoaded, match="--classifier"):
        bare.engine.prepare_embed("x", TEXTS, CLASSIFY)
    with pytest.raises(NotLoaded, match="--sparse-embedder"):
        bare.engine.prepare_embed("x", TEXTS, SPARSE)


def test_a_decoder_is_refused_as_a_classifier(tmp_path) -> None:
    from engine.embed import Embedder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="--classifier"):
        Embedder.load(str(tmp_path), task=PoolingTask.CLASSIFY)
