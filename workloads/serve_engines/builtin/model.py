"""The built-in engine's model: a checkpoint and its tokenizer on the CPU (fp32) or a GPU (bf16), generating
token by token (:class:`Engine`), with sampling (greedy, top-k, top-p, seeded) and stop strings."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infra import failpoints, phases

log = logging.getLogger("nemoflow.serve")


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "length" | "stop"


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop string (not yet safe to stream)."""
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold


class HFTokenizer:
    """sentencepiece's interface over a transformers tokenizer.

    For checkpoints without ``tokenizer.model`` whose tokenizer was written by ``save_pretrained``
    (``tokenizer.json`` / ``tokenizer_config.json``, as NeMo AutoModel's consolidated checkpoints
    are). With ``tokenizer.model`` present, sentencepiece itself is used (see the module docstring).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def bos_id(self) -> int:
        return -1 if self.tokenizer.bos_token_id is None else int(self.tokenizer.bos_token_id)

    def eos_id(self) -> int:
        return -1 if self.tokenizer.eos_token_id is None else int(self.tokenizer.eos_token_id)

    def get_piece_size(self) -> int:
        return len(self.tokenizer)


def load_tokenizer(checkpoint: Path):
    """sentencepiece on ``tokenizer.model`` when the checkpoint has one, else its HF tokenizer files."""
    if (checkpoint / "tokenizer.model").is_file():
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(checkpoint / "tokenizer.model"))
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(checkpoint)))


def _attention_without_cudnn():
    """Scaled dot-product attention by any backend but cuDNN's, for one decoding step.

    Each step attends over one more cached token: a new shape at every step of a request. On the H200 (torch 2.11)
    a first pass over a prompt's lengths took 82 ms a token where the same lengths again took 18 ms, and the
    profile showed SDPA running cuDNN's attention, which builds an execution plan for each new shape: the likely
    cause, not yet confirmed (benchmarks/bench_builtin_decode.py times both choices; docs/serving.md). Flash,
    memory-efficient and math attention have no per-shape plan. The flags are the process's; the context restores
    them after the step (the lock keeps steps one at a time)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class Engine:
    """One model and its sentencepiece tokenizer, on the CPU (fp32) or a GPU (bf16).

    Forward passes are serialised by a lock (one model: parallel passes would only fight
    over the cores or the GPU's queue); concurrent requests interleave step by step, each
    with its own KV cache. Sampling runs on the CPU (one vocabulary-sized row per token),
    so a seeded request picks the same tokens from the same logits on either device.
    """

    def __init__(self, checkpoint: Path, add_bos: bool = True, threads: int | None = None, device: str = "auto"):
        self.checkpoint = checkpoint
        self.add_bos = add_bos
        self.threads = threads
        self.device_choice = device
        self.device = None
        self.model = None
        self.sp = None
        self.context_length = 0
        self.lock = threading.Lock()

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        phases.switch(phases.BUILD)  # the model load; the imports before it count as the process's start
        started = time.monotonic()
        device = resolve_device(self.device_choice)
        sp = load_tokenizer(self.checkpoint)
        # bf16 on a GPU, as the trainer computes; fp32 on the CPU (bf16 matmuls are slow there)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(self.checkpoint), dtype=dtype).to(device)
        model.eval()
        self.device = device
        vocab = model.config.vocab_size
        if sp.get_piece_size() > vocab:
            raise ValueError(
                f"{self.checkpoint}: the tokenizer has {sp.get_piece_size()} pieces but the model's "
                f"vocab_size is {vocab}: the tokenizer does not belong to this checkpoint"
            )
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.sp, self.model = sp, model
        # The KV cache argument is `past_key_values` up to transformers 5.18 (NeMo AutoModel's pin), `cache` later.
        import inspect

        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "loaded %s (%s, %.1fM parameters, context %d) on %s (%s) in %.1fs",
            self.checkpoint,
            type(model).__name__,
            params / 1e6,
            self.context_length,
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            str(dtype).removeprefix("torch."),
            time.monotonic() - started,
        )

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.sp.encode(text)
        bos = self.sp.bos_id()
        return ([bos] if self.add_bos and bos >= 0 else []) + ids

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[str, Generation | None]]:
        """Yield text deltas as they become final, then ``("", Generation)`` once at the end."""
        import torch

        eos = self.sp.eos_id()
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
        out_ids: list[int] = []
        text, sent = "", 0
        finish, hit_eos = "length", False
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        cache = None
        delay_s = int(failpoints.value("serve.step_delay_ms") or 0) / 1000
        for _ in range(params.max_tokens):
            if delay_s:
                time.sleep(delay_s)
            # Lock and inference mode per step, never across a yield: a streaming client may
            # go away mid-answer (the generator is then abandoned, not resumed), and each
            # step may run on a different thread of the pool.
            with self.lock, torch.inference_mode(), _attention_without_cudnn():
                out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
                cache = getattr(out, self.cache_arg)
                next_id = self._pick(out.logits[0, -1].float().cpu(), params, generator)
            if next_id == eos:
                finish, hit_eos = "stop", True
                break
            out_ids.append(next_id)
            text = self._continuation(prompt_ids, out_ids)
            cut = _first_stop(text, params.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            # An incomplete UTF-8 sequence (byte-fallback pieces) decodes to U+FFFD until it is complete.
            safe = len(text) - _held_back(text, params.stop)
            while safe > sent and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > sent:
                yield text[sent:safe], None
                sent = safe
            input_ids = torch.tensor([[next_id]], dtype=torch.long, device=self.device)
        if len(text) > sent:
            yield text[sent:], None
        # The end-of-sequence token was generated too: it counts, as in OpenAI's usage.
        yield "", Generation(text, len(prompt_ids), len(out_ids) + hit_eos, finish)

    def _continuation(self, prompt_ids: list[int], out_ids: list[int]) -> str:
        """The generated text as it continues the prompt.

        sentencepiece drops the word-boundary space of the first piece it decodes
        ("▁God" alone is "God"), which would glue the completion to the prompt.
        Decoding after the last prompt token and removing that token's text keeps it.
        """
        anchor = [i for i in prompt_ids[-1:] if i != self.sp.bos_id()]
        if anchor:
            head = self.sp.decode(anchor)
            full = self.sp.decode(anchor + out_ids)
            if full.startswith(head):
                return full[len(head) :]
        return self.sp.decode(out_ids)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        result = None
        for _, done in self.stream(prompt_ids, params):
            result = done or result
        assert result is not None
        return result

    @staticmethod
    def _pick(logits, params: SamplingParams, generator) -> int:
        """Greedy, or sample after top-k and top-p (nucleus) filtering.

        A full sort of a 32000-entry vocabulary costs ~5 ms on CPU, more than a forward
        pass of a small model, so candidates come from ``topk``: the k of top_k, or for
        top_p alone the best 1024 when they already hold the requested mass (a full sort
        otherwise). Sampling inverts the cumulative distribution with one seeded draw.
        """
        import torch

        if params.greedy:
            return int(torch.argmax(logits))
        logits = logits.float() / params.temperature
        vocab = logits.numel()
        if 0 < params.top_k < vocab:
            values, ids = torch.topk(logits, params.top_k)
            probs = torch.softmax(values, dim=-1)  # renormalised over the k kept
        elif params.top_p < 1.0:
            full = torch.softmax(logits, dim=-1)
            probs, ids = torch.topk(full, min(vocab, 1024))
            if float(probs.sum()) < params.top_p:
                probs, ids = torch.sort(full, descending=True)
        else:
            probs, ids = torch.softmax(logits, dim=-1), None
        if params.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            cumulative = torch.cumsum(probs, dim=-1)
            probs = probs.masked_fill(cumulative - probs >= params.top_p, 0.0)
        cumulative = torch.cumsum(probs, dim=-1)
        draw = torch.rand(1, generator=generator, dtype=cumulative.dtype) * cumulative[-1]
        index = min(int(torch.searchsorted(cumulative, draw, right=True)), probs.numel() - 1)
        return int(ids[index]) if ids is not None else index


def resolve_device(choice: str):
    """The built-in engine's device: ``auto`` = the first visible GPU, else the CPU; ``cuda`` without one fails."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda but torch sees no GPU (CUDA_VISIBLE_DEVICES empty, no driver, or a CPU build of torch)"
        )
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")
