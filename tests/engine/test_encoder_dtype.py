"""EngineConfig.encoder_dtype: what "auto" resolves to on which CPU, and the bf16 encoders it picks on CPUs with
native bf16, held to sentence-transformers' float32 vectors and the float32 engine's scores within the bounds
docs/embeddings.md "Precision" states. The bf16 path is forced by name, so it runs on every CPU (torch converts bf16
to float32 around the FMA units where the CPU has no bf16 dot products)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.linear
from engine import LLM, EngineConfig
from engine.config import EMBEDDED_EMBEDDER
from engine.embed.embedder import embedded_embedder_dir
from engine.models.encoder_loader import resolve_encoder_dtype
from engine.settings import Settings

QUERY = "How do bees make honey?"
DOCUMENTS = ["Bees collect nectar from flowers and store it in their honey stomach.",
             "The stock market fell three percent on Tuesday.",
             "Worker bees fan their wings to evaporate water from nectar, turning it into honey.",
             "A recipe for tomato soup with basil.",
             "Beekeepers harvest honey from the frames of a hive in late summer."]
# docs/embeddings.md "Precision": bf16 encoders' vectors against float32 (measured: least cosine .99995, largest
# component error 2.0e-3 and score error 6.6e-4 on these texts; the bounds leave ~5x)
MIN_COSINE = 0.9995
SCORE_ATOL = 3e-3
# docs/embeddings.md "Endpoints": one input alone and the same input packed with others, per component, per encoder
# dtype. float32: summation order only (measured ~2e-7). bfloat16: oneDNN's bf16 GEMMs round per block of the packed
# batch, so a row's vector depends on its neighbours more (measured up to 1.6e-3 on "hello world" alone and in a batch
# of 3, AMX, 2026-12); the bound leaves ~3x, and the vectors stay at cosine >= MIN_COSINE of each other.
BATCHING_ATOL = {"float32": 1e-5, "bfloat16": 5e-3}
# What `--encoder-dtype auto` runs on this host under the default settings (TANDEM_NATIVE_BF16 unset): bfloat16 on a
# CPU with native bf16, float32 elsewhere. tests/conftest.py pins float32 for the parity tests; the tests of a promise
# (batch invariance, the doors' vectors and scores, rerank order) also run under this. Passed by name, so the
# process-wide quantized-matmul path (chosen from TANDEM_NATIVE_BF16 at each engine build) stays as pinned.
HOST_ENCODER_DTYPE = resolve_encoder_dtype("auto", "float32", "cpu", native_bf16=True)
BATCH_TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog near the river bank today.",
               "Bees make honey from nectar collected from many flowers in the summer months."]


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_for_a_float32_cpu_encoder_with_native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(kernels.linear, "native_bf16", lambda: native)
    cpu = "bfloat16" if native else "float32"
    assert resolve_encoder_dtype("auto", "float32", "cpu", native_bf16=True) == cpu
    assert resolve_encoder_dtype("auto", "float32", "cpu", native_bf16=False) == "float32"  # TANDEM_NATIVE_BF16=0
    assert resolve_encoder_dtype("auto", "float32", "cpu", True, decoder=True) == "float32"  # a decoder embedder
    assert resolve_encoder_dtype("auto", "float32", "cuda", True) == "float32"
    assert resolve_encoder_dtype("auto", "float16", "cpu", True) == "float16"  # the engine's dtype otherwise
    for asked in ("float32", "bfloat16", "float16"):  # asked by name: taken as asked
        assert resolve_encoder_dtype(asked, "float32", "cpu", True, decoder=True) == asked


def test_the_setting_and_its_environment_switch() -> None:
    assert EngineConfig().encoder_dtype == "auto"
    with pytest.raises(ValueError, match="encoder_dtype must be auto, float32, float16 or bfloat16"):
        EngineConfig(encoder_dtype="int8")
    assert Settings.from_env({}).native_bf16 is True
    assert Settings.from_env({"TANDEM_NATIVE_BF16": "0"}).native_bf16 is False


@pytest.fixture(scope="module")
def st_vectors() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    return st.encode([QUERY, *DOCUMENTS], normalize_embeddings=True)


@pytest.fixture(scope="module")
def bf16() -> LLM:
    return LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="dense", encoder_dtype="bfloat16",
                            num_kv_blocks=64))


def test_bf16_embedder_vectors_are_sentence_transformers_within_the_stated_bound(bf16, st_vectors) -> None:
    assert bf16.engine.embedder.dtype == "bfloat16"
    got = np.asarray(bf16.embed([QUERY, *DOCUMENTS]), dtype=np.float64)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)  # normalised in float32 after pooling
    cosines = (got * st_vectors).sum(axis=1)
    assert cosines.min() >= MIN_COSINE
    assert np.abs(got - st_vectors).max() > 1e-5  # it did run in bf16: float32 is within 2e-7 of these vectors


def test_bf16_dense_rerank_scores_are_the_float32_cosines_within_the_bound(bf16, st_vectors) -> None:
    scores = bf16.rerank(QUERY, DOCUMENTS)
    want = [(1 + float(st_vectors[0] @ v)) / 2 for v in st_vectors[1:]]
    assert scores == pytest.approx(want, abs=SCORE_ATOL)
    assert len(set(scores)) == len(scores)  # float32 cosines of bf16 vectors: no ties from bf16 rounding


def test_bf16_cross_encoder_scores_are_float32_numbers_near_the_float32_scores(tmp_path) -> None:
    """A cross-encoder under encoder_dtype bfloat16: its weights in bf16, its scores the float32 sigmoid of the
    logits (a bf16 sigmoid would round scores to ~3 digits and tie near ones)."""
    from tests.models_built import minilm_cross_encoder_dir

    ce = minilm_cross_encoder_dir(tmp_path / "ce")
    runs = {dtype: LLM(EngineConfig(reranker=str(ce), encoder_dtype=dtype, num_kv_blocks=64))
            for dtype in ("float32", "bfloat16")}
    assert runs["bfloat16"].engine.scorer.encoder.dtype == "bfloat16"
    assert runs["float32"].engine.scorer.encoder.dtype == "float32"
    got, want = (runs[d].rerank(QUERY, DOCUMENTS) for d in ("bfloat16", "float32"))
    assert got == pytest.approx(want, abs=2e-2)
    assert got != want  # it ran in bf16
    assert all(isinstance(s, float) for s in got) and len(set(got)) == len(got)


def test_a_modernbert_embedder_in_bf16_and_a_decoder_embedder_keeps_the_engine_dtype_under_auto(tmp_path,
                                                                                                 monkeypatch) -> None:
    from engine.config import EmbedParams
    from engine.embed.embedder import Embedder
    from tests.engine.test_embed import TEXTS, _modernbert_dir, tiny_qwen3_embedder

    _modernbert_dir(tmp_path / "mb")
    runs = {d: Embedder.load(str(tmp_path / "mb"), encoder_dtype=d) for d in ("float32", "bfloat16")}
    assert runs["bfloat16"].dtype == "bfloat16"
    rows = [r.token_ids for r in runs["float32"].rows(TEXTS, None, EmbedParams())]
    want, got = (runs[d].embed(rows) for d in ("float32", "bfloat16"))
    assert got.dtype == torch.float32  # pooled in float32
    # a random tiny model keeps less of its signal through bf16 than a trained one (measured .9988 here, .99995 on
    # the trained MiniLM above)
    assert torch.nn.functional.cosine_similarity(got, want).min().item() >= 0.995
    assert (got - want).abs().max().item() > 1e-6  # it ran in bf16

    monkeypatch.setattr(kernels.linear, "native_bf16", lambda: True)
    torch.manual_seed(3)
    tiny_qwen3_embedder(tmp_path / "qwen3")
    assert Embedder.load(str(tmp_path / "qwen3"), encoder_dtype="auto", settings=Settings()).dtype == "float32"
    assert Embedder.load(str(tmp_path / "mb"), encoder_dtype="auto", settings=Settings()).dtype == "bfloat16"


@pytest.fixture(scope="module")
def host_default() -> LLM:
    return LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="dense", encoder_dtype=HOST_ENCODER_DTYPE,
                            num_kv_blocks=64))


def test_host_default_vectors_hold_the_batching_bound_docs_state_for_its_dtype(host_default) -> None:
    """docs/embeddings.md: the same text alone and packed with others, within the bound of the dtype the host runs."""
    assert host_default.engine.embedder.dtype == HOST_ENCODER_DTYPE
    bound = BATCHING_ATOL[HOST_ENCODER_DTYPE]
    for text in [*BATCH_TEXTS, *DOCUMENTS[:2]]:
        alone = np.asarray(host_default.embed([text])[0], dtype=np.float64)
        for batch in ([text, *BATCH_TEXTS], [*BATCH_TEXTS, text], [*DOCUMENTS, text], [text, text]):
            vectors = np.asarray(host_default.embed(batch), dtype=np.float64)
            packed = vectors[len(batch) - 1 if batch[0] != text else 0]
            assert np.abs(packed - alone).max() < bound, (text, batch)
            assert float(packed @ alone) >= MIN_COSINE


def test_host_default_dense_rerank_keeps_float32s_order_and_scores_alone_or_together(host_default,
                                                                                     st_vectors) -> None:
    together = host_default.rerank(QUERY, DOCUMENTS)
    alone = [host_default.rerank(QUERY, [d])[0] for d in DOCUMENTS]
    want = [(1 + float(st_vectors[0] @ v)) / 2 for v in st_vectors[1:]]
    atol = SCORE_ATOL if HOST_ENCODER_DTYPE == "bfloat16" else 1e-5
    assert together == pytest.approx(want, abs=atol)
    assert alone == pytest.approx(together, abs=atol)
    order = sorted(range(len(want)), key=lambda i: -want[i])
    assert sorted(range(len(together)), key=lambda i: -together[i]) == order
