"""Embeddings through the engine: vectors equal sentence-transformers' on the embedded all-MiniLM-L6-v2 (and a
transformers reference on a tiny random ModernBERT and a tiny last-token Qwen3 decoder), truncation and token-id
input, the three kinds of work in one scheduler (step records count embedding rows and tokens), aborts."""
from __future__ import annotations

import json

import pytest
import torch

from tests.models_built import copy_minilm_tokenizer
from engine import LLM, EmbedParams, EngineConfig, SamplingParams
from engine.config import EMBEDDED_EMBEDDER
from engine.embed import Embedder, Pooling, embedded_embedder_dir
from engine.outputs import EmbedOutput
from engine.settings import Settings
from tests.engine.conftest import assert_no_leaks, record_steps

TEXTS = ["A lighthouse keeper trims the wick and winds the clockwork that turns the lens every night of the year.",
         "Fog horns sound when the light cannot be seen.", "Bananas.",
         "Ships read the light's pattern of flashes on their charts to know which lighthouse they are passing by."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # num_kv_blocks: a small KV pool for short prompts; the default 1 GiB is zero-filled at every build (~0.6 s of a core)
    return LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, max_num_batched_tokens=256, num_kv_blocks=64))


def _cos(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b).float(), dim=-1)


def test_the_embedded_model_matches_sentence_transformers(llm: LLM) -> None:
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    long_text = " ".join(TEXTS * 8)  # over max_seq_length (256): sentence-transformers cuts it at the right
    ours = llm.embed(TEXTS + [long_text])
    theirs = ref.encode(TEXTS + [long_text], convert_to_tensor=True)
    assert _cos(ours, theirs).min().item() >= 0.9999
    assert torch.tensor(ours).norm(dim=-1).sub(1).abs().max().item() < 1e-5
    assert _cos(ours[0], ours[2]).item() < 0.9  # different texts, different vectors


def test_all_tokens_are_sentence_transformers_token_embeddings_and_pooled_rows_in_the_same_step_stay_pooled(
        llm: LLM) -> None:
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    long_text = " ".join(TEXTS * 8)  # cut to 256 tokens, [SEP] last, as sentence-transformers cuts it
    texts = [TEXTS[0], TEXTS[2], long_text]
    theirs = ref.encode(texts, output_value="token_embeddings")  # unpadded, special tokens included, not normalised
    pooled_id, whole_id = "pooled", "whole"
    llm.engine.add_embed(pooled_id, TEXTS, EmbedParams())
    llm.engine.add_embed(whole_id, texts, EmbedParams(all_tokens=True, normalize=False))
    finals = {}
    while llm.engine.has_unfinished():
        finals.update({o.request_id: o.embeddings for o in llm.engine.step() if o.finished})
    ours = finals[whole_id]
    assert [len(t) for t in ours] == [len(t) for t in theirs] and len(ours[2]) == 256
    for mine, st in zip(ours, theirs):
        assert torch.tensor(mine).sub(st).abs().max().item() < 1e-4
    assert torch.tensor(ours[0]).norm(dim=-1).sub(1).abs().min().item() > 1e-2  # raw states, not unit length
    assert _cos(finals[pooled_id], llm.embed(TEXTS)).min().item() > 0.999999  # the other job's vectors: pooled
    mean = torch.tensor(ours[1]).mean(0)
    assert _cos(mean, llm.embed([TEXTS[2]])[0]).item() > 0.99999  # mean pooling of exactly these states
    with pytest.raises(ValueError, match="all_tokens"):
        EmbedParams(all_tokens=True, dimensions=8)


def test_token_ids_are_the_models_exact_input(llm: LLM) -> None:
    """Token ids as the tokenizer returns them by default ([CLS] ... [SEP]) are embedded as given, to the text's
    vector; nothing is added again (which moved the vector to cosine 0.949)."""
    tok = llm.engine.embedder.tokenizer
    ids = [list(tok(t).input_ids) for t in TEXTS[:2]]
    rows = llm.engine.embedder.rows(None, ids, EmbedParams())
    assert [r.token_ids for r in rows] == ids
    assert _cos(llm.embed(ids), llm.embed(TEXTS[:2])).min().item() > 0.999999


def test_truncation_off_refuses_a_long_input_and_left_truncation_keeps_the_end(llm: LLM) -> None:
    long_text = " ".join(TEXTS * 8)
    with pytest.raises(ValueError, match="takes at most 256"):
        llm.embed([long_text], EmbedParams(truncate=False))
    left = llm.embed([long_text], EmbedParams(truncation_direction="left"))
    right = llm.embed([long_text])
    assert _cos(left, right).item() < 0.9999


def test_dimensions_are_refused_for_a_model_not_trained_for_them(llm: LLM) -> None:
    with pytest.raises(ValueError, match="not trained for shortened vectors"):
        llm.embed(["x"], EmbedParams(dimensions=128))
    assert len(llm.embed(["x"], EmbedParams(dimensions=384))[0]) == 384


def test_bad_inputs_name_the_field(llm: LLM) -> None:
    for bad in ([], [""], ["a", [1, 2]], [[]], [[10 ** 9]]):
        with pytest.raises(ValueError, match="input"):
            llm.engine.prepare_embed("x", bad)


def test_without_an_embedder_embed_says_how_to_load_one() -> None:
    with pytest.raises(ValueError, match="no embedding model"):
        LLM().embed(["x"])


def test_three_kinds_of_work_share_steps_and_records_count_embedding_rows(llm: LLM) -> None:
    engine = llm.engine
    records = []
    engine.add_observer(records.append)
    try:
        engine.add_request("g", "Hello there", SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        engine.add_rerank("r", "lighthouse", TEXTS[:2])
        engine.add_embed("e", TEXTS)
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        engine.remove_observer(records.append)
    assert isinstance(finished["e"], EmbedOutput) and len(finished["e"].embeddings) == len(TEXTS)
    # the rerank (dense, the default with an embedder) is embedder rows too: its query and two documents
    fused_rows = engine.embedder.rows(["lighthouse", *TEXTS[:2]], None, EmbedParams())
    # a row that ran in stages costs a share of its tokens in each step (rounded up): at least its tokens in all
    assert finished["e"].prompt_tokens + sum(len(r.token_ids) for r in fused_rows) <= sum(
        r.embed_tokens for r in records)
    assert finished["e"].prompt_tokens > 0
    assert sum(r.embed_rows_done for r in records) == len(TEXTS) + len(fused_rows)
    assert sum(r.embed_rows for r in records) >= len(TEXTS) + len(fused_rows)
    assert finished["r"].scores is not None and len(finished["g"].text) >= 0
    assert any(r.embed_rows and (r.prefill_tokens or r.rerank_tokens or r.decode_tokens) for r in records)
    assert all(r.budget_used <= r.budget for r in records)
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_an_aborted_embedding_frees_everything_and_ends_with_abort(llm: LLM) -> None:
    engine = llm.engine
    engine.add_embed("a", TEXTS * 40)  # more rows than one step takes
    engine.step()
    assert engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.embeddings) for o in outs] == [("a", "abort", None)]
    assert not engine.has_unfinished() and engine.scheduler.num_waiting == 0 and not engine.scheduler.running


def tiny_modernbert(directory, vocab_size: int = 30522, cls: int = 101, sep: int = 102):
    """A tiny random ModernBERT body (local window 8, a global layer every 3), weights drawn far from init's
    near-constant output, saved to `directory` (no tokenizer): the model."""
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
                              max_position_embeddings=512, pad_token_id=0, cls_token_id=cls, sep_token_id=sep,
                              bos_token_id=cls, eos_token_id=sep)
    model = ModernBertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return model


def _modernbert_dir(tmp_path):
    torch.manual_seed(3)
    model = tiny_modernbert(tmp_path)
    copy_minilm_tokenizer(tmp_path)
    return model


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_tiny_modernbert_embedder_matches_transformers(tmp_path, pooling: str) -> None:
    hf = _modernbert_dir(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"}))
    emb = Embedder.load(str(tmp_path))
    assert emb.pooling is Pooling(pooling) and not emb.sentence.normalize
    rows = [r.token_ids for r in emb.rows(TEXTS, None, EmbedParams())]
    assert max(len(r) for r in rows) > 2 * 8  # longer than the local window
    ours = emb.embed(rows)
    with torch.inference_mode():
        states = [hf(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]
    ref = torch.stack([s[0] if pooling == "cls" else s.mean(0) for s in states])
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ref.std(0).mean().item() > 1e-3


def tiny_qwen3_embedder(directory, max_positions: int = 256):
    """A tiny random Qwen3-Embedding-style decoder (saved as the bare Qwen3Model, SmolLM2's tokenizer): the model."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    from engine.models.loader import default_model_dir

    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=max_positions, tie_word_embeddings=True)
    config.architectures = ["Qwen3Model"]
    hf = Qwen3Model(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(directory)
    AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir)).save_pretrained(directory)
    return hf


def test_a_tiny_last_token_decoder_embedder_matches_transformers(tmp_path) -> None:
    torch.manual_seed(11)
    hf = tiny_qwen3_embedder(tmp_path)
    emb = Embedder.load(str(tmp_path))
    assert emb.pooling is Pooling.LAST_TOKEN and emb.matryoshka and emb.dim == 64
    rows = [r.token_ids for r in emb.rows(TEXTS, None, EmbedParams())]
    ours = emb.embed(rows)
    with torch.inference_mode():
        ref = torch.stack([hf(input_ids=torch.tensor([r])).last_hidden_state[0, -1] for r in rows])
    assert (ours - ref).abs().max().item() <= 1e-4
    short = Embedder.finish(ours[0], EmbedParams(dimensions=16))  # Matryoshka: cut, then renormalised
    assert len(short) == 16 and abs(torch.tensor(short).norm().item() - 1) < 1e-5
    assert _cos(short, torch.nn.functional.normalize(ref[0, :16], dim=-1)).item() > 0.99999


def test_a_tiny_roberta_embedder_matches_transformers(tmp_path) -> None:
    """RoBERTa (and XLM-R, the same layout) counts positions from pad_token_id + 1; saved as a bare RobertaModel."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(4)
    config = RobertaConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
    hf = RobertaModel(config, add_pooling_layer=False).eval()
    hf.save_pretrained(tmp_path)
    copy_minilm_tokenizer(tmp_path)
    emb = Embedder.load(str(tmp_path))
    assert emb.pooling is Pooling.MEAN and emb.max_length == 128  # no modules.json: mean; positions from 2
    rows = [r.token_ids for r in emb.rows(TEXTS, None, EmbedParams())]
    with torch.inference_mode():
        ref = torch.stack([hf(input_ids=torch.tensor([r])).last_hidden_state[0].mean(0) for r in rows])
    assert (emb.embed(rows) - ref).abs().max().item() <= 1e-4


def test_a_bidirectional_decoder_embedder_is_refused_by_name(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "use_bidirectional_attention": True,
                                                      "architectures": ["Gemma3TextModel"]}))
    with pytest.raises(ValueError, match="bidirectional attention"):
        Embedder.load(str(tmp_path))


def test_a_step_of_embeddings_alone_takes_up_to_the_embedding_budget_and_one_beside_a_chat_does_not() -> None:
    llm = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, max_num_batched_tokens=128, max_embed_batch_tokens=600,
                           num_kv_blocks=64))
    engine = llm.engine
    records = record_steps(llm)
    texts = [f"{t} (copy {i})" for i in range(8) for t in TEXTS]  # 32 rows of 10-30 tokens: ~600 tokens in all
    engine.add_embed("alone", texts)
    while engine.has_unfinished():
        engine.step()
    alone = [r.embed_tokens for r in records if r.embed_rows]
    assert max(alone) > 128 and all(n <= 600 for n in alone)  # wider than the step budget, within its own
    assert all(r.budget == 600 and r.budget_used <= r.budget for r in records if r.embed_tokens > 128)
    records.clear()
    engine.add_request("chat", "Hello there", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the prompt
    engine.add_embed("beside", texts)
    while engine.has_unfinished():
        engine.step()
    beside = [r for r in records if r.embed_rows and r.decode_tokens]
    assert beside and all(r.budget_used <= 128 for r in beside)  # a chat in the step: the step budget holds
    assert_no_leaks(llm)
