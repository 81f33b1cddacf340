"""A minimal embedding server around sentence-transformers: the split deployment's embedding side when Infinity does
not run here (bench/pipeline.py says which one a run used).

    python -m bench.peers.st_server --port 8081 --threads 1 [--model DIR] [--reranker DIR]

`POST /v1/embeddings` (OpenAI's shape: `input` a string or a list of strings) and `POST /rerank` (TEI's shape:
`query`, `texts`; scores are the cosine of the normalised MiniLM vectors, which is what tandem's default dense rerank
computes; with `--reranker DIR`, a sentence-transformers `CrossEncoder` of that directory scores the pairs instead,
as `tandem serve --reranker DIR` does), `GET /health`. One uvicorn worker, `torch.set_num_threads(--threads)`,
requests encoded one at a time in a worker thread (sentence-transformers' `encode` / `predict`, batch size 32), as a
plain sentence-transformers service would.
It imports nothing of tandem but the embedded model's location.
"""
from __future__ import annotations

import argparse
import asyncio


def build_app(model_dir: str, threads: int, reranker_dir: str | None = None):
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir, device="cpu")
    cross = CrossEncoder(reranker_dir, device="cpu") if reranker_dir else None
    lock = asyncio.Lock()  # one encode at a time: what one worker process of a plain server does

    async def encode(texts: list[str]):
        async with lock:
            return await asyncio.to_thread(model.encode, texts, batch_size=32, normalize_embeddings=True,
                                           convert_to_numpy=True)

    async def embeddings(request):
        body = await request.json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = await encode(texts)
        return JSONResponse({"object": "list", "model": body.get("model", "minilm"),
                             "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                      for i, v in enumerate(vectors)]})

    async def cosine_scores(query: str, texts: list[str]):
        vectors = await encode([query, *texts])
        return vectors[1:] @ vectors[0]

    async def cross_scores(query: str, texts: list[str]):
        async with lock:
            return await asyncio.to_thread(cross.predict, [(query, t) for t in texts], batch_size=32,
                                           convert_to_numpy=True)

    async def rerank(request):
        body = await request.json()
        scores = await (cross_scores if cross is not None else cosine_scores)(body["query"], body["texts"])
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
        return JSONResponse([{"index": i, "score": float(scores[i])} for i in order])

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                             Route("/rerank", rerank, methods=["POST"]), Route("/health", health)])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a sentence-transformers directory (default: the embedded MiniLM)")
    ap.add_argument("--reranker", default=None, help="a cross-encoder directory: /rerank scores with it")
    args = ap.parse_args(argv)
    if args.model is None:
        from engine.embed.embedder import embedded_embedder_dir

        args.model = str(embedded_embedder_dir())
    uvicorn.run(build_app(args.model, args.threads, args.reranker), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
