"""A continuous-batching rollout engine for CPU: the serving loop behind ``rollout.name=cpu``.

Each request owns a KV cache. Every :meth:`RolloutEngine.step` runs ONE packed forward over the
running batch: the whole prompt of each newly admitted request (prefill) together with the last
sampled token of every request already decoding. Requests join and leave the batch at any step.

Sampling is per request: a request's own ``torch.Generator`` (seeded from its seed) draws from its
own row of probabilities, so a request yields the same tokens alone or inside a busy batch. The
log-prob returned for each sampled token is read from the very distribution it was drawn from
(temperature applied, fp32 log-softmax) - the behaviour log-prob FlashREINFORCE needs.

The model forward goes through :func:`true_on_policy.rollout.packed_forward.forward_packed`, the same
module code the trainer runs; with the consistent kernels switched on, the two sides compute every
log-prob with identical floating-point operations. No verl import here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import torch

from true_on_policy.kernels import ops
from true_on_policy.rollout.packed_forward import KVCache, forward_packed


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "completed" (eos/stop token), "length" or "aborted"


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    cache: KVCache | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_log_probs: list[float] = dataclasses.field(default_factory=list)

    @property
    def next_input(self) -> list[int]:
        """Tokens to feed this step: the prompt at prefill, else the last sampled token."""
        return self.prompt_ids if not self.output_ids else self.output_ids[-1:]

    @property
    def next_position(self) -> int:
        return self.cache.length


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log-softmax of ``logits / temperature`` over the full vocabulary, row by row.

    Exactly what the trainer computes for a scored token: verl divides the logits by the
    temperature (clamped at 1e-8, in the logits' dtype) and takes the log-softmax.
    """
    if temperature != 1.0:
        logits = logits / torch.tensor(temperature, dtype=torch.float32).clamp(min=1e-8).to(logits.dtype)
    return ops.log_softmax(logits)


_PER_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _packed_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a packed expert tensor that a per-expert checkpoint weight ``name`` fills.

    transformers packs Qwen-MoE experts as ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows)
    and ``down_proj`` [E, H, I]; verl's ``unfuse_moe_params`` splits them exactly this way.
    """
    match = _PER_EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    experts, index, proj = match["experts"], int(match["index"]), match["proj"]
    if proj == "down_proj":
        packed = params.get(f"{experts}.down_proj")
        return packed[index] if packed is not None and index < packed.shape[0] else None
    packed = params.get(f"{experts}.gate_up_proj")
    if packed is None or index >= packed.shape[0]:
        return None
    gate, up = packed[index].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


class RolloutEngine:
    """Continuous batching over per-request KV caches.

    Args:
        model: a transformers causal LM (an architecture of kernels/architectures.py), in its serving dtype.
        eos_token_id: ends a request (besides its own stop tokens and its length budget).
        max_num_seqs: most requests in the running batch; the rest wait in arrival order.
        max_model_len: prompt + response budget of one request.
        seed: the engine seed; a request without its own seed gets one derived from it, the
            policy version of the loaded weights and its prompt tokens - never from how many
            loads this process has seen, so a resumed server samples what an uninterrupted one
            would (see :meth:`load_weights`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int | Iterable[int] | None,
        max_num_seqs: int = 64,
        max_model_len: int = 1024,
        seed: int = 0,
        forward: Callable = forward_packed,
    ):
        self.model = model.eval()
        if eos_token_id is None:
            eos_token_id = ()
        self.eos_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.seed = seed
        self.weight_version = 0
        self._forward = forward
        self._waiting: deque[_Request] = deque()
        self._running: OrderedDict[str, _Request] = OrderedDict()
        self._aborted: list[Completion] = []

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_ids)} tokens leaves no room within "
                f"max_model_len={self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else derive_seed(self.seed, self.weight_version, prompt_ids)
        generator = torch.Generator().manual_seed(seed)
        self._waiting.append(_Request(request_id, list(prompt_ids), params, generator))

    def abort(self, request_id: str) -> Completion | None:
        """Stop one request now; its partial output is returned (and reported by the next step)."""
        for queue_request in list(self._waiting):
            if queue_request.request_id == request_id:
                self._waiting.remove(queue_request)
                return self._retire(queue_request, "aborted")
        request = self._running.pop(request_id, None)
        return self._retire(request, "aborted") if request is not None else None

    def abort_all(self) -> list[Completion]:
        ids = [r.request_id for r in self._waiting] + list(self._running)
        return [self.abort(request_id) for request_id in ids]

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ----------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy trainer weights in by name (cast to the serving dtype); drops every KV cache.

        ``version`` is the policy version of the weights (the trainer's global step): it enters the
        per-request seeds, so a server started after a resume seeds requests as an uninterrupted one.
        Without it (offline use) the version counts loads.

        MoE experts may arrive one per expert (``...mlp.experts.3.gate_proj.weight``, the checkpoint
        layout verl streams to rollout engines) and land in transformers' packed expert tensors.
        """
        if self.has_work():
            raise RuntimeError("load_weights while requests are in flight: abort or drain them first")
        params = dict(self.model.named_parameters())
        loaded = 0
        for name, tensor in named_tensors:
            target = _packed_expert_slice(params, name) if name not in params else params[name]
            if target is None:
                raise KeyError(f"trainer sent weight {name!r}, which the rollout model does not have")
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != rollout {tuple(target.shape)}")
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
            loaded += 1
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return loaded

    # ----------------------------------------------------------------- serving loop
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            request.cache = KVCache()
            self._running[request.request_id] = request

    def _retire(self, request: _Request, reason: str) -> Completion:
        request.cache = None  # frees its keys and values
        return Completion(request.request_id, request.output_ids, request.output_log_probs, reason)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """One forward over the running batch; returns the requests that finished in it."""
        self._admit()
        if not self._running:
            return []
        requests = list(self._running.values())
        inputs, positions, seq_lens = [], [], []
        for request in requests:
            tokens = request.next_input
            start = request.next_position
            inputs.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            seq_lens.append(len(tokens))
        last_rows = torch.tensor(seq_lens).cumsum(0) - 1
        logits = self._forward(
            self.model,
            torch.tensor(inputs, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            seq_lens,
            [request.cache for request in requests],
            logits_rows=last_rows,
        )
        finished = []
        for row, request in enumerate(requests):
            temperature = request.params.temperature
            log_probs = sampling_log_probs(logits[row : row + 1], temperature or 1.0)[0]
            if temperature == 0:  # greedy; the log-prob reported is the untempered one
                token = int(torch.argmax(log_probs))
            else:
                token = int(torch.multinomial(log_probs.exp(), 1, generator=request.generator))
            request.output_ids.append(token)
            request.output_log_probs.append(float(log_probs[token]))
            reason = self._stop_reason(request, token)
            if reason is not None:
                del self._running[request.request_id]
                finished.append(self._retire(request, reason))
        return finished

    def _stop_reason(self, request: _Request, token: int) -> str | None:
        if token in self.eos_token_ids or token in request.params.stop_token_ids:
            return "completed"
        total = len(request.prompt_ids) + len(request.output_ids)
        if len(request.output_ids) >= request.params.max_new_tokens or total >= self.max_model_len:
            return "length"
        return None

    def run_until_done(self) -> dict[str, Completion]:
        """Serve every queued request to completion (offline use: tests, logdiff, benchmarks)."""
        done: dict[str, Completion] = {}
        while self.has_work():
            for completion in self.step():
                done[completion.request_id] = completion
        return done
