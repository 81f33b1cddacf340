"""Cross-encoder reranking through the engine: same scheduler steps as decodes, no KV blocks used."""
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from engine import RerankParams, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_llm

QUERY = "how do lighthouses warn ships at night"
DOCS = ["A rotating lamp and a Fresnel lens send a beam far over the sea.",
        "Bread rises because yeast produces carbon dioxide.",
        "Fog horns sound when the light cannot be seen.",
        "lighthouse keeper beam " * 300]  # longer than the model's 512 positions: truncated at the end


@pytest.fixture(scope="module")
def ce_llm(minilm_dir):
    return make_llm(reranker=str(minilm_dir), max_num_batched_tokens=1024)


def test_engine_scores_equal_transformers(ce_llm, minilm_dir):
    scores = ce_llm.rerank(QUERY, DOCS)
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        enc = tok([QUERY] * len(DOCS), DOCS, truncation="only_second", max_length=512, padding=True,
                  return_tensors="pt")
        ref = torch.sigmoid(hf(**enc).logits[:, 0]).tolist()
    assert max(abs(a - b) for a, b in zip(scores, ref)) <= 1e-4
    assert_no_leaks(ce_llm)


def test_pairs_ride_with_decodes_and_take_no_kv_blocks(ce_llm):
    eng = ce_llm.engine
    gen = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = ce_llm.generate(["Lighthouses are"], gen)[0].token_ids
    records = []
    eng.add_observer(records.append)
    eng.add_request("g", "Lighthouses are", gen)
    outs = eng.step()
    free_before = eng.stats()["kv_blocks_free"]
    eng.add_rerank("job", QUERY, [f"document {i} about beams and fog" for i in range(300)])
    while eng.has_unfinished():
        outs.extend(eng.step())
        assert eng.stats()["kv_blocks_free"] >= free_before - 1  # only the decode may take a block
    assert [t for o in outs if o.request_id == "g" for t in o.new_token_ids] == solo
    job = next(o for o in outs if o.request_id == "job")
    assert len(job.scores) == 300
    assert any(r.rerank_pairs and r.decode_tokens for r in records)
    assert_no_leaks(ce_llm)


def test_pair_over_the_limit_with_truncate_none_is_rejected(ce_llm):
    with pytest.raises(ValueError, match=r"documents\[3\] .*over the rerank pair limit of 512 \(the cross-encoder.s max_position_embeddings\)"):
        ce_llm.engine.add_rerank("bad", QUERY, DOCS, RerankParams(truncate="none"))
    assert_no_leaks(ce_llm)
