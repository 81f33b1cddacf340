"""The LLM reranker recipes (engine/rerank/recipes.py) on tiny random causal LMs saved with transformers: each
recipe's scores equal its published recipe computed here with plain transformers (within 1e-4), offline and through
both doors (gRPC Rerank with its instruction field; HTTP Cohere /v1/rerank and TEI /rerank, instruction as a body
field), and the recipe is read from the model directory where it says it.

* qwen3: the Qwen3-Reranker model card (its tests/models/test_qwen3_reranker_recipe.py has the card's code; here the
  recipe is found from the directory's name alone).
* mxbai-v2: the mxbai-rerank library's MxbaiRerankV2.prepare_inputs / forward (score logit("1") - logit("0") at the
  last position; tandem reports its sigmoid).
* template: a bge-reranker-v2-gemma-style template with one "Yes" token (sigmoid of its logit).
"""
from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from clients import Client
from engine import LLM, EngineConfig, RerankParams
from engine.models.loader import default_model_dir
from engine.rerank.recipes import RerankTemplate, recipe_from_dir, resolve
from engine.settings import Settings
from service.server import ServerConfig
from tests.models.test_qwen3_reranker_recipe import model_card_scores
from tests.service.harness import ServerThread

QUERY = "how do bees make honey?"
DOCS = ["Bees collect nectar from flowers and turn it into honey in the hive.", "The stock market fell on Tuesday.",
        "Honey is stored in wax combs.", "42 is the answer, according to a novel."]
INSTRUCTION = "Given a question, find passages that answer it"

# mxbai_rerank/mxbai_rerank_v2.py (MxbaiRerankV2), as published
MX_TASK = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
           "query-document pair, carefully analyze the semantic relationship between them, then provide your binary "
           "relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
MX_PREFIX = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n" \
            "<|im_start|>user\n"
MX_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"

# A bge-reranker-v2-gemma-style prompt (FlagEmbedding: "A: {query}", "B: {passage}", its yes/no question; "Yes")
GEMMA_TEMPLATE = {"template": "A: {query}\nB: {document}\n{instruction}", "classifier_from_token": ["Yes"],
                  "instruction": "Given a query A and a passage B, determine whether the passage contains an answer "
                                 "to the query by providing a prediction of either 'Yes' or 'No'."}


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def mxbai_input_ids(tok, query: str, doc: str, instruction: str | None) -> list[int]:
    """MxbaiRerankV2.prepare_inputs for one pair (no truncation at these lengths, no padding)."""
    def ids(x):
        return tok(x, add_special_tokens=False)["input_ids"]
    query_prompt = f"query: {query}"
    if instruction:
        query_prompt = "".join([f"instruction: {instruction}", "\n", query_prompt])
    body = ids(query_prompt) + ids("\n") + ids(f"document: {doc}")
    return ids(MX_PREFIX) + body + ids("\n") + ids(MX_TASK) + ids(MX_SUFFIX)


def mxbai_scores(model, tok, query, docs, instruction) -> list[float]:
    """MxbaiRerankV2.forward: logits[:, -1, yes_loc] - logits[:, -1, no_loc], "1" and "0"; as a sigmoid."""
    yes, no = tok("1", add_special_tokens=False)["input_ids"][0], tok("0", add_special_tokens=False)["input_ids"][0]
    out = []
    with torch.inference_mode():
        for d in docs:
            logits = model(torch.tensor([mxbai_input_ids(tok, query, d, instruction)])).logits[0, -1]
            out.append(torch.sigmoid(logits[yes] - logits[no]).item())
    return out


def template_scores(model, tok, query, docs, instruction) -> list[float]:
    """The template rendered whole and tokenized once, sigmoid of the "Yes" logit at the last position."""
    yes = tok("Yes", add_special_tokens=False)["input_ids"][0]
    out = []
    with torch.inference_mode():
        for d in docs:
            text = GEMMA_TEMPLATE["template"].format(query=query, document=d,
                                                     instruction=instruction or GEMMA_TEMPLATE["instruction"])
            logits = model(torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits[0, -1]
            out.append(torch.sigmoid(logits[yes]).item())
    return out


def _save_tiny(path, arch: str, seed: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))  # ChatML tokens
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    config = Qwen2Config(**kw) if arch == "qwen2" else Qwen3Config(head_dim=16, **kw)
    config.architectures = ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # spread the logits so the scores are far from 0.5 and from each other
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


# recipe -> (directory name that declares it, architecture, reference, extra files)
CASES = {"qwen3": ("Qwen3-Reranker-tiny", "qwen3", model_card_scores),
         "mxbai-v2": ("mxbai-rerank-tiny-v2", "qwen2", mxbai_scores),
         "template": ("gemma-style-reranker", "qwen3", template_scores)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name, arch, reference = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param) / name
    model, tok = _save_tiny(path, arch, seed=3 + len(request.param))
    if request.param == "template":  # the directory says its recipe with its own template file
        (path / "rerank_template.json").write_text(json.dumps(GEMMA_TEMPLATE))
    # no rerank_mode, no recipe: read from the directory; plain budget filling (no start-up calibration to wait for)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=128, tpot_target_ms=None))
    want = {instr: reference(model, tok, QUERY, DOCS, instr) for instr in (None, INSTRUCTION)}
    yield request.param, path, llm, tok, want


def test_the_recipe_is_read_from_the_directory_and_matches_its_reference(case):
    recipe, path, llm, tok, want = case
    assert recipe_from_dir(str(path)).value == recipe
    scorer = llm.engine.scorer
    assert scorer.mode == "judge" and scorer.recipe.value == recipe
    for instr, ref in want.items():
        got = llm.rerank(QUERY, DOCS, RerankParams(instruction=instr))
        assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4, (recipe, instr, got, ref)
        # and in logit space, where a random model's scores near 0 or 1 still differ: tight, and the documents are
        # told apart by ten times that
        assert max(abs(logit(a) - logit(b)) for a, b in zip(got, ref)) <= 2e-3, (recipe, instr, got, ref)
        assert max(map(logit, ref)) - min(map(logit, ref)) > 2e-2, ref
    assert max(abs(logit(a) - logit(b)) for a, b in zip(want[None], want[INSTRUCTION])) > 4e-3  # instruction read
    if recipe == "mxbai-v2":  # token for token the library's input
        pairs, _ = scorer.pairs(QUERY, DOCS, RerankParams(instruction=INSTRUCTION), 10**6)
        assert [p.token_ids for p in pairs] == [mxbai_input_ids(tok, QUERY, d, INSTRUCTION) for d in DOCS]


def test_both_doors_pass_the_instruction_and_score_by_the_recipe(case):
    recipe, _, llm, _, want = case
    server = ServerThread(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    try:
        url = server.add_http(server.server.config).url
        with Client(server.address) as c:
            grpc_got = {r.index: r.score for r in c.rerank(QUERY, DOCS, instruction=INSTRUCTION)}
        with httpx.Client(base_url=url, timeout=600) as h:
            cohere = h.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "instruction": INSTRUCTION})
            tei = h.post("/rerank", json={"query": QUERY, "texts": DOCS, "instruction": INSTRUCTION})
            tei_plain = h.post("/rerank", json={"query": QUERY, "texts": DOCS})
        for r in (cohere, tei, tei_plain):
            assert r.status_code == 200, r.text
        cohere_got = {x["index"]: x["relevance_score"] for x in cohere.json()["results"]}
        tei_got = {x["index"]: x["score"] for x in tei.json()}
        plain_got = {x["index"]: x["score"] for x in tei_plain.json()}
        for got in (grpc_got, cohere_got, tei_got):
            assert max(abs(got[i] - want[INSTRUCTION][i]) for i in range(len(DOCS))) <= 1e-4, (recipe, got)
        assert max(abs(plain_got[i] - want[None][i]) for i in range(len(DOCS))) <= 1e-4
    finally:
        server.close()


def test_flags_name_the_recipe_and_bad_templates_are_refused(tmp_path):
    assert resolve(None, None, str(tmp_path))[0].value == "qwen3"  # a directory that says nothing: qwen3
    assert resolve("mxbai-v2", None, str(tmp_path))[0].value == "mxbai-v2"
    recipe, template = resolve(None, json.dumps(GEMMA_TEMPLATE), None)
    assert recipe.value == "template" and template.tokens == ("Yes",)
    file = tmp_path / "t.json"
    file.write_text(json.dumps(GEMMA_TEMPLATE))
    assert RerankTemplate.parse(str(file)) == template
    for bad, says in ((dict(template="{query} only"), "{document}"),
                      (dict(template="{query} {document} {other}"), "slots"),
                      (dict(template="{query} {document}", classifier_from_token=["a", "b", "c"]), "one token"),
                      (dict(template="{query} {document}", tokenz=["x"]), "unknown keys")):
        with pytest.raises(ValueError, match=says):
            RerankTemplate.parse(json.dumps(bad))
    with pytest.raises(ValueError, match="needs a template"):
        resolve("template", None, str(tmp_path))
    with pytest.raises(ValueError, match="judge mode"):
        EngineConfig(rerank_recipe="qwen3", rerank_mode="likelihood")
    with pytest.raises(ValueError, match="rerank_recipe must be one of"):
        EngineConfig(rerank_recipe="bge")
