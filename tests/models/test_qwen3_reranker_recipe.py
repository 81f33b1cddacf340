"""The judge rerank mode on a tiny random Qwen3 (ChatML tokenizer) equals the Qwen3-Reranker model card's
p(yes), computed here with transformers exactly as the card's code does (its prefix, instruction/query/document
layout, suffix with the empty think block, softmax over the "no"/"yes" logits at the last position)."""
from __future__ import annotations

import torch

from engine import LLM, EngineConfig, RerankParams
from engine.models.loader import default_model_dir
from engine.settings import Settings

QUERY = "how do bees make honey"
DOCS = ["Bees collect nectar from flowers and turn it into honey in the hive.", "The stock market fell on Tuesday.",
        "Honey is stored in wax combs.", "42 is the answer, according to a novel."]
INSTRUCTION = "Given a question, find passages that answer it"


def card_inputs(tokenizer, query: str, docs: list[str], instruction: str) -> list[list[int]]:
    """The Qwen3-Reranker model card's input ids per pair (its process_inputs, without padding)."""
    def format_instruction(instruction, query, doc):
        if instruction is None:
            instruction = "Given a web search query, retrieve relevant passages that answer the query"
        return "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
            instruction=instruction, query=query, doc=doc)

    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    pairs = [format_instruction(instruction, query, doc) for doc in docs]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=8192 - len(prefix_tokens) - len(suffix_tokens))
    return [prefix_tokens + ele + suffix_tokens for ele in inputs["input_ids"]]


def model_card_scores(model, tokenizer, query: str, docs: list[str], instruction: str) -> list[float]:
    """The model card's compute_logits, one pair at a time (so no padding), in transformers."""
    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    scores = []
    with torch.inference_mode():
        for ele in card_inputs(tokenizer, query, docs, instruction):
            ids = torch.tensor([ele])
            batch_scores = model(ids).logits[:, -1, :]
            true_vector = batch_scores[:, token_true_id]
            false_vector = batch_scores[:, token_false_id]
            batch_scores = torch.stack([false_vector, true_vector], dim=1)
            batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
            scores.append(batch_scores[:, 1].exp().item())
    return scores


def test_judge_mode_equals_the_model_cards_formula(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    torch.manual_seed(11)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))  # ChatML: <|im_start|>, <|im_end|>
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # spread the yes/no logits so the scores are far from 0.5
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    want = model_card_scores(model, tokenizer, QUERY, DOCS, INSTRUCTION)
    llm = LLM(EngineConfig(model=str(tmp_path), rerank_mode="judge"))
    assert llm.engine.scorer.card_layout
    got = llm.rerank(QUERY, DOCS, RerankParams(instruction=INSTRUCTION))
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4, (got, want)
    assert max(want) - min(want) > 1e-3  # ten times the tolerance: the documents really are told apart
    # and token for token the card's input: prefix + tokenizer(format_instruction(...)) + suffix
    pairs, _ = llm.engine.scorer.pairs(QUERY, DOCS, RerankParams(instruction=INSTRUCTION), 10**6)
    assert [p.token_ids for p in pairs] == card_inputs(tokenizer, QUERY, DOCS, INSTRUCTION)
