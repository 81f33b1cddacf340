"""bench/pipeline.py's bookkeeping (each kind beside the others as a ratio to itself alone) and its harness."""
from __future__ import annotations

import sys

import pytest

from bench.pipeline import ratios


def test_ratios_divide_each_kind_beside_the_others_by_itself_alone():
    phases = {"chats_alone": {"tpot_p99_ms": 50.0, "chat_tokens_per_s": 100.0},
              "reranks_alone": {"rerank_p50_s": 0.3}, "embeds_alone": {"texts_per_s": 80.0},
              "W1": {"tpot_p99_ms": 70.0, "rerank_p50_s": 1.2},
              "W2": {"tpot_p99_ms": 60.0, "chat_tokens_per_s": 75.0, "texts_per_s": 20.0}}
    got = ratios(phases)
    assert got == pytest.approx({"W1_chat_p99_x": 1.4, "W1_rerank_p50_x": 4.0, "W2_chat_tokens_x": 0.75,
                                 "W2_chat_p99_x": 1.2, "W2_embed_rate_x": 0.25})


def test_a_client_that_dies_fails_the_phase_instead_of_hanging_it():
    """The rerank client's request fails (nothing listens on the port), so its process exits without a report: the
    phase raises, naming it, where it used to wait on the queue for ever (a split run's W5 hung so)."""
    from types import SimpleNamespace

    from bench.pipeline import ClientDied, _phase
    from service.cluster import free_port

    scorer = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}", embed_path="/v1/embeddings",
                             rerank_by_embedding=False)
    args = SimpleNamespace(max_tokens=4, batch=2, embed_clients=1, seconds=0.1)
    with pytest.raises(ClientDied, match="exited with"):
        _phase(None, scorer, args, [], [("q", ["a", "b"])], ["a"], reranks=True)


def test_w5s_long_document_has_its_words_and_the_splits_windows_cover_it_once():
    from bench.pipeline import chunk_words, long_document

    doc = long_document(["one two three", "four five"], 11)
    assert doc.split() == ["one", "two", "three", "four", "five", "one", "two", "three", "four", "five", "one"]
    pieces = chunk_words(doc, 4)
    assert len(pieces) == 4 and " ".join(pieces) == doc  # every word once, in order
    assert max(len(p.split()) for p in pieces) - min(len(p.split()) for p in pieces) <= 2


def test_w5_long_is_a_ratio_to_its_own_rerank_alone_and_the_one_chat_alone():
    phases = {"W5_chat_alone": {"tpot_p90_ms": 10.0}, "W5_rerank_alone": {"rerank_p50_s": 20.0},
              "W5": {"tpot_p90_ms": 15.0, "rerank_p50_s": 30.0},
              "W5_long_rerank_alone": {"rerank_p50_s": 2.0}, "W5_long": {"tpot_p90_ms": 12.0, "rerank_p50_s": 2.5}}
    assert ratios(phases) == pytest.approx({"W5_chat_p90_x": 1.5, "W5_rerank_x": 1.5,
                                            "W5_long_chat_p90_x": 1.2, "W5_long_rerank_x": 1.25})


def test_embedding_texts_are_counted_by_the_part_of_each_response_inside_the_window():
    from bench.pipeline import texts_in_window

    responses = [(0.0, 4.0, 32), (4.0, 12.0, 32), (12.0, 20.0, 32), (1.0, 3.0, 8)]
    # window 2..14: half of the first (16), all of the second (32), a quarter of the third (8), half of the last (4)
    assert texts_in_window(responses, (2.0, 14.0)) == pytest.approx(16 + 32 + 8 + 4)
    assert texts_in_window(responses, (20.0, 30.0)) == 0


_CHATTY_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/health":  # ready at once; then a request's worth of log, past a pipe's 64 KiB
            sys.stderr.write("x" * 100_000 + "\\n")
            sys.stderr.flush()
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_that_logs_every_request_keeps_serving(tmp_path):
    """llama-server logs each request to stderr; Proc kept it in a pipe nobody read, so once 64 KiB had piled up its
    writes blocked and it stopped answering mid-phase. A server writing 100 KB a request answers every one."""
    import httpx

    from bench.servers import Proc
    from service.cluster import free_port

    script = tmp_path / "chatty.py"
    script.write_text(_CHATTY_SERVER)
    port = free_port()
    proc = Proc([sys.executable, str(script), str(port)], port)
    try:
        # a timeout only so a regression fails instead of hanging the suite: a blocked server never answers at all
        assert all(httpx.get(f"{proc.url}/x", timeout=60).text == "ok" for _ in range(5))
    finally:
        proc.stop()


def test_the_printed_table_marks_each_median_against_its_target_and_w3_per_split():
    from bench.pipeline import table

    def run(w1_p99, rerank, texts):
        return {"phases": {"chats_alone": {"tpot_p99_ms": 100.0}, "W1": {"tpot_p99_ms": w1_p99, "rerank_p50_s": rerank},
                           "W2": {"tpot_p99_ms": w1_p99, "texts_per_s": texts}}}

    result = {"runs": {"tandem": [run(120.0, 5.0, 9.0)], "split_pinned": [run(130.0, 2.0, 20.0)],
                       "tandem_T": [run(130.0, 6.0, 8.0) | {"T_ms": 45.0}]},
              "median": {"tandem": {"W1_chat_p99_x": 1.2, "W1_rerank_p50_x": 5.4},
                         "split_pinned": {"W1_chat_p99_x": 1.3, "W1_rerank_p50_x": 1.0},
                         "tandem_T": {"W1_chat_p99_x": 1.3, "W1_rerank_p50_x": 6.0}}}
    text = table(result).splitlines()
    rerank = next(line for line in text if line.startswith("W1_rerank_p50_x"))
    assert rerank.split()[3:] == ["5.40x", "MISS", "1.00x", "6.00x", "MISS"]
    assert "MISS" not in next(line for line in text if line.startswith("W1_chat_p99_x"))
    assert "W4 run: W1 chats' p99 130 ms <= 110 ms: MISS" in text  # max(1.25 x 45, 1.1 x 100)
    w3 = next(line for line in text if line.startswith("W3 tandem vs split_pinned"))
    assert "W1 tpot_p99_ms 120 vs 130 (ahead)" in w3 and "W1 rerank_p50_s 5 vs 2 (behind)" in w3
    assert "W2 texts_per_s 9 vs 20 (behind)" in w3
