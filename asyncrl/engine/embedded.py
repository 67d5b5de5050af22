"""The embedded engine: batched generation with a KV cache on a Hugging Face causal LM.

Prompts are left-padded so that every row decodes at the same column; position ids follow
the attention mask, so padding never shifts a sequence. When a row finishes (a stop token
or its token budget) it is removed from the batch and from the KV cache at once, so
finished sequences stop costing compute. Each generated token records the behaviour
log-prob and the engine's policy version at the time it was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.sampling import SamplingParams, sample_tokens
from asyncrl.engine.types import GenerationRequest, GenerationResult


class EmbeddedEngine:
    """Generates completions for batches of requests with one in-process model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        max_batch_size: int = 512,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.version = version
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.stats = {"decode_steps": 0, "tokens_generated": 0, "busy_s": 0.0}

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Copy a complete set of parameters into the engine's model and adopt their policy version.

        The update must name every parameter of the model exactly once, with matching shapes;
        a partial or mismatched update is refused before anything is copied.
        """
        if version < self.version:
            raise ValueError(f"policy version went backwards: engine at {self.version}, update is {version}")
        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        params = dict(self.model.named_parameters())
        missing, unknown = params.keys() - items.keys(), items.keys() - params.keys()
        if missing or unknown:
            raise ValueError(
                f"weight update for version {version} is incomplete or foreign: "
                f"missing {sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}"
            )
        for name, tensor in items.items():
            if tensor.shape != params[name].shape:
                raise ValueError(
                    f"weight update: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in items.items():
                params[name].copy_(tensor)
        self.version = version

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        for start in range(0, len(requests), self.max_batch_size):
            for res in self._generate_batch(requests[start : start + self.max_batch_size]):
                results[res.request_id] = res
        return [results[r.request_id] for r in requests]

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        t0 = time.perf_counter()
        dev = self.device
        for r in requests:
            need = len(r.prompt_ids) + r.sampling.max_new_tokens
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id!r} has an empty prompt")
            if need > self.max_positions:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({len(r.prompt_ids)} tokens) + max_new_tokens "
                    f"({r.sampling.max_new_tokens}) exceeds the model's {self.max_positions} positions"
                )
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        params = [r.sampling for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        budget = torch.tensor([p.max_new_tokens for p in params], dtype=torch.long, device=dev)
        stop = _stop_matrix(params, dev)

        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
        next_pos = positions[:, -1] + 1
        active = torch.arange(n, device=dev)
        tokens_out: list[list[int]] = [[] for _ in range(n)]
        logps_out: list[list[float]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        step = 0
        while True:
            tok, lp = sample_tokens(logits, temperature, top_k, top_p, self.generator)
            step += 1
            is_stop = (stop == tok.unsqueeze(-1)).any(-1)
            done = is_stop | (budget <= step)
            for i, t, lp_i, stopped in zip(
                active.tolist(), tok.tolist(), lp.tolist(), is_stop.tolist(), strict=True
            ):
                tokens_out[i].append(t)
                logps_out[i].append(lp_i)
                if stopped:
                    finish[i] = "stop"
            keep = ~done
            if not bool(keep.any()):
                break
            if bool(done.any()):
                idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                active, attention, next_pos, tok = active[idx], attention[idx], next_pos[idx], tok[idx]
                temperature, top_k, top_p, budget, stop = (
                    temperature[idx],
                    top_k[idx],
                    top_p[idx],
                    budget[idx],
                    stop[idx],
                )
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            out = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=attention,
                position_ids=next_pos.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        self.stats["decode_steps"] += step
        self.stats["tokens_generated"] += sum(len(t) for t in tokens_out)
        self.stats["busy_s"] += time.perf_counter() - t0
        return [
            GenerationResult(
                request_id=r.request_id,
                completion_ids=tokens_out[i],
                logprobs=logps_out[i],
                versions=[self.version] * len(tokens_out[i]),
                finish_reason=finish[i],
            )
            for i, r in enumerate(requests)
        ]


def _stop_matrix(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """(B, S) stop token ids per row, padded with -1 (never a token id)."""
    width = max((len(p.stop_token_ids) for p in params), default=0) or 1
    m = torch.full((len(params), width), -1, dtype=torch.long)
    for i, p in enumerate(params):
        if p.stop_token_ids:
            m[i, : len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids)
    return m.to(device)
